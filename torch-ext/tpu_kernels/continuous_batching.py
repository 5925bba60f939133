"""transformers' continuous batching (`model.generate_batch`) on these kernels: an attention function for transformers'
AttentionInterface that, given transformers' PagedAttentionCache, writes each step's new K/V into the cache with
reshape_and_cache_flash (in place, at transformers' own write indices) and attends with ragged_paged_attention
directly over the cache's pages. Without a paged cache it is flash_attention_ops.attention_forward.

    name = "kernels-community/tpu-kernels:flash_paged"
    model = AutoModelForCausalLM.from_pretrained(model_id, attn_implementation=name)
    kernel.register_continuous_batching(model)  # after loading: the name now runs paged_attention_forward
    model.generate_batch(prompts, generation_config=config)

Why that spelling and the call. generate_batch accepts "sdpa", "paged|eager" or a name containing "flash" (only a
flash name gets transformers' packed batches without masks). Loading a model with a name containing "flash"
imports a flash attention implementation for it: a Hub kernel name ("org/repo:suffix", any suffix) loads the kernel,
a name of one's own fails (flash_attn is not installed). For a kernel with flash_attn_varlen_func transformers then
registers its own flash_attention_forward under the name whatever the suffix says (that wrapper writes and gathers
the cache in torch, then calls our flash_attn_varlen_func); register_continuous_batching replaces that entry (and
sets flash attention's mask function), so it is called after loading.

How transformers' cache is laid out, and how it is used here. One flat buffer per attention type (an allocator: full
or sliding attention) holds, block after block, one page of K then one page of V of every layer of that type, each
page `page_size` tokens of [kv_heads, head_dim]. Layer i of the group reads its K at rows 2 i page_size + x and its V
at (2 i + 1) page_size + x of the buffer seen as rows, x = transformers' physical index (write_index, read_index).
- The write: the K and V page views transformers reads a layer through overlap by all but one page, and
  reshape_and_cache_flash updates each of its caches as a whole array (donated on TPU, copied back on CPU), so they
  cannot be its two caches. Its caches are the buffer's two halves instead (its pages split in the middle: two
  distinct contiguous tensors, nothing copied): a first call writes the new rows that fall in the first half as keys,
  with as values the second half's rows at the same slots as they are; a second call writes the rows that fall in
  the second half as values, with the first half's rows at those slots (read after the first call) as keys. Each new
  row is written once and one other row rewritten unchanged; a key-only mode of the write would drop the rewrites.
- The attention: ragged_paged_attention over the buffer's pages from 0 as K and from 1 as V (read only, so their
  overlap is harmless; one pair of views for every layer, so one compiled program), the layer's pages 2 i further
  on, page tables derived on the device from the read /
  write indices (the physical index of each page's first token, over page_size), kv_lens from cu_seq_lens_k.
- Sliding window layers keep a ring buffer of `sliding_window` slots (token p at slot p % window), rotated once a
  request is longer than the window. Before it wraps (every context of the step shorter than the window) slots are
  positions and the pages read as for full attention. A request with one query (a decode) reads its whole ring,
  every slot a key of its window, as the context: its pages in ring order (the ring's pages rotated by its position,
  from transformers' position_ids; the last page partial when the window is not a multiple of the page), the order of
  the keys being irrelevant to a single query's attention. A chunk of several queries whose window wrapped cannot be
  read after its write (its later tokens overwrite keys its earlier queries need): for such a step the layer gathers
  the window's K/V at transformers' read indices (before the write, the new tokens at the sentinel slots), runs
  flash_attn_varlen_func on them, then writes with reshape_and_cache_flash. Every write and every attention is still
  one of these ops. (Without position_ids only one-page rings are read at a decode; others gather.)
transformers' decode fast path (block_table, flash_attn_with_kvcache) and its padded batches (CUDA graphs) are enabled
on CUDA / XPU only: a block_table is refused with an error.
"""

import torch

from . import flash_attention_ops, kv_cache_ops, paged_attention_ops

CB_ATTENTION = "kernels-community/tpu-kernels:flash_paged"
FULL_ATTENTION = "full_attention"
# Each new token count, sequence count or page-table width is a new compiled program of the kernels (a new export on
# TPU): they are padded to powers of two, each to at least these many, so that steps share programs (padding tokens
# and sequences are skipped by the kernels; a sequence and a page-table column are SMEM words).
MIN_TOKENS = 16
MIN_SEQS = 8
MIN_PAGES = 8


def _bucket(size: int, minimum: int) -> int:
    return max(minimum, 1 << max(size - 1, 0).bit_length())


def register_continuous_batching(model) -> str:
    """Make the model's attention (transformers' registry entry for its attn_implementation, which must contain
    "flash") paged_attention_forward, with flash attention's mask function. `model`: a model loaded with
    attn_implementation="kernels-community/tpu-kernels:flash_paged" (see the module docstring), or that name.
    Call it after loading: loading registers transformers' own wrapper under the name. Returns the name."""
    name = model if isinstance(model, str) else model.config._attn_implementation
    if not isinstance(name, str) or "flash" not in name:
        raise ValueError(
            f"model: generate_batch takes a flash attention name only (one containing 'flash', e.g. "
            f"{CB_ATTENTION!r}), got attn_implementation {name!r}"
        )
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(name, paged_attention_forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return name


def _is_paged_cache(cache) -> bool:
    if cache is None:
        return False
    from transformers.generation.continuous_batching import PagedAttentionCache

    return isinstance(cache, PagedAttentionCache)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: with `cache` a PagedAttentionCache (continuous batching), the new K/V
    written into it by reshape_and_cache_flash and ragged_paged_attention over its pages (see the module docstring);
    otherwise flash_attention_ops.attention_forward (its options: scaling, sliding_window, softcap, is_causal, s_aux).
    query [1, Hq, T, D], key / value [1, Hkv, T, D] -> ([1, T, Hq, D], None). Inference only."""
    if not _is_paged_cache(cache):
        return flash_attention_ops.attention_forward(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("dropout"):
        raise ValueError(f"dropout: continuous batching is inference only, expected 0.0, got {kwargs['dropout']}")
    if query.shape[0] != 1:
        raise ValueError(f"query: expected transformers' packed batch [1, heads, tokens, head_dim], got {query.shape}")
    if kwargs.get("block_table") is not None:
        raise ValueError(
            "block_table: expected None (paged_attention_forward reads the pages by transformers' write_index and "
            "read_index; its block-table decode path is flash_attn_with_kvcache's, CUDA / XPU only), got a tensor"
        )
    is_causal, softcap, s_aux = kwargs.get("is_causal"), kwargs.get("softcap"), kwargs.get("s_aux")
    scaling, sliding_window = kwargs.get("scaling"), kwargs.get("sliding_window")
    causal = bool(module.is_causal if is_causal is None else is_causal)
    step = _Step(cache, module.layer_idx, kwargs)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    attend = dict(
        softmax_scale=scaling,
        causal=causal,
        window_size=flash_attention_ops._window(sliding_window),
        softcap=0.0 if softcap is None else softcap,
    )
    if step.paged(sliding_window):
        step.write(k, v)
        out = step.attend(q, sinks=s_aux, **attend)
    else:
        k_ctx, v_ctx = step.gather_window(k, v)  # before the write: the ring's new slots hold keys still needed
        out = step.attend_gathered(q, k_ctx, v_ctx, s_aux=s_aux, **attend)
        step.write(k, v)
    return out.unsqueeze(0), None


class _Step:
    """One layer's view of a continuous batching step: its allocator's buffer and the step's indices."""

    def __init__(self, cache, layer_idx, kwargs):
        self.allocator = a = cache.layer_to_allocator[layer_idx]
        self.layer = a.layer_indices.index(layer_idx)
        self.page = a.tokens_per_page
        rows = a.cache_tensor  # [tokens, 2, kv_heads, head_dim]
        self.buffer = rows.view(-1, self.page, *rows.shape[2:])  # every page of the group: K and V of each layer
        self.cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
        self.max_q = int(kwargs["max_length_q"])
        self.cu_k, self.max_k = kwargs["cu_seq_lens_k"], kwargs["max_length_k"]
        if isinstance(self.cu_k, dict):  # per layer type, as transformers' paged cache hands them
            self.cu_k, self.max_k = self.cu_k[a.layer_type], self.max_k[a.layer_type]
        self.cu_k, self.max_k = self.cu_k.to(torch.int32), int(self.max_k)
        self.write_index = kwargs["write_index"][a.index]
        positions = kwargs.get("position_ids")  # each new token's position (transformers passes them to attention)
        self.positions = None if positions is None else positions.reshape(-1)
        self.read_index = kwargs["read_index"][a.index]

    # ------------------------------------------------------------------------------------------------------ pages
    def attend(self, q, **options):
        """ragged_paged_attention of q [T, Hq, D] over the layer's pages, its sizes padded to _bucket's."""
        tokens, seqs = q.shape[0], self.cu_q.numel() - 1
        table = self.page_table()
        padded_seqs, padded_pages = _bucket(seqs, MIN_SEQS), _bucket(table.shape[1], MIN_PAGES)
        table = torch.nn.functional.pad(table, (0, padded_pages - table.shape[1], 0, padded_seqs - seqs))
        kv_lens = torch.nn.functional.pad(self.cu_k.diff(), (0, padded_seqs - seqs))
        cu_q = torch.nn.functional.pad(self.cu_q, (0, padded_seqs - seqs), value=tokens)
        q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, _bucket(tokens, MIN_TOKENS) - tokens))
        # one view pair for every layer of the group (one compiled program): K pages from 0, V pages from 1, the
        # layer's pages 2 i further on
        k_pages, v_pages = self.buffer[:-1], self.buffer[1:]
        out = paged_attention_ops.ragged_paged_attention(
            q, k_pages, v_pages, kv_lens, table + 2 * self.layer, cu_q, num_seqs=seqs, **options
        )
        return out[:tokens]

    def attend_gathered(self, q, k, v, **options):
        """flash_attn_varlen_func of q [T, Hq, D] over gathered contexts k / v [Tk, Hkv, D], its sizes padded as
        attend's: the padding rows form one more sequence (its queries see as many padding keys or more: every row
        has keys) whose rows are dropped, then empty sequences up to the bucket."""
        tokens, keys, seqs = q.shape[0], k.shape[0], self.cu_q.numel() - 1
        padded_q = _bucket(tokens, MIN_TOKENS)
        padded_k = _bucket(keys + padded_q - tokens, 2 * MIN_TOKENS)  # contexts outnumber queries
        q, k, v = (
            torch.nn.functional.pad(x, (0, 0, 0, 0, 0, n - x.shape[0]))
            for x, n in ((q, padded_q), (k, padded_k), (v, padded_k))
        )
        more = _bucket(seqs + 1, MIN_SEQS) - seqs
        cu_q, cu_k = (
            torch.nn.functional.pad(cu, (0, more), value=n) for cu, n in ((self.cu_q, padded_q), (self.cu_k, padded_k))
        )
        out = flash_attention_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, padded_q, padded_k, **options)
        return out[:tokens]

    def sliding(self) -> bool:
        return self.allocator.layer_type != FULL_ATTENTION

    def paged(self, sliding_window) -> bool:
        """Whether this step's contexts are pages the kernel can read (see the module docstring)."""
        if not self.sliding():
            return True
        window = self.allocator.sliding_window
        if self.max_k < window:  # no ring has wrapped: slots are positions
            return True
        # a request's ring may have wrapped only if its context reaches the window; a single query reads the whole
        # ring, rotated by its position (or, without positions, a ring of one page as it lies)
        single = self.positions is not None or window <= self.page
        if self.max_q == 1 and single:
            return True
        q_lens, k_lens = self.cu_q.diff(), self.cu_k.diff()
        return not bool(((k_lens >= window) & ((q_lens > 1) | (not single))).any())

    def page_table(self):
        """[N, pages] page indices of the layer's page views: each page's first context token's physical index over
        page_size, from transformers' read indices (write indices where the batch reads nothing; a sliding layer's
        sentinels, its new tokens, replaced by their write indices). A wrapped ring's read indices start at ring slot
        (past + 1) % window: page j's first slot j * page_size is read entry (j * page_size - that) % window."""
        window = self.allocator.sliding_window if self.sliding() else 0
        if self.sliding() and self.positions is None and self.max_q == 1 and window <= self.page:
            # one-page rings: the page holding each request's new token
            return (self.write_index[self.cu_q[:-1].long()] // self.page).to(torch.int32)[:, None]
        if self.read_index.numel() == 0:
            physical, starts = self.write_index, self.cu_q
        else:
            physical, starts = self.read_index, self.cu_k
            if self.sliding():
                sentinel = physical == self.allocator.sentinel_index
                physical = physical.masked_scatter(sentinel, self.write_index)
        lengths = starts.diff().long()[:, None]
        pages = max(1, -(-self.max_k // self.page))
        offsets = self.page * torch.arange(pages, device=physical.device)[None, :]
        inside = offsets < lengths
        if self.sliding() and self.positions is not None and self.read_index.numel():
            past = self.positions[self.cu_q[:-1].long()].long()[:, None]
            start = torch.where(past >= window, (past + 1) % window, 0)
            offsets = (offsets - start) % lengths.clamp(min=1)
        index = torch.where(inside, starts[:-1, None].long() + offsets, 0).clamp(max=max(physical.numel() - 1, 0))
        return torch.where(inside, physical[index] // self.page, 0).to(torch.int32)

    # ------------------------------------------------------------------------------------------------------ write
    def slots(self):
        """Slots of the new tokens in this layer's K page view (-1: not stored, transformers' write trash)."""
        trash = self.write_index == self.allocator.write_trash_index
        return torch.where(trash, -1, self.write_index)

    def write(self, k, v):
        """k / v [T, kv_heads, D] written into the buffer in place by two reshape_and_cache_flash calls over its two
        halves (see the module docstring): the first writes the new rows that fall in the first half as keys, the
        second those in the second half as values, each rewriting its slots' rows of the other half as they are."""
        slots = self.slots()
        skip = slots < 0
        offset = 2 * self.layer * self.page
        rows_at = torch.cat([torch.where(skip, -1, slots + offset), torch.where(skip, -1, slots + offset + self.page)])
        rows = torch.cat([k, v])
        padded = 2 * _bucket(k.shape[0], MIN_TOKENS)
        rows = torch.nn.functional.pad(rows, (0, 0, 0, 0, 0, padded - rows.shape[0]))
        rows_at = torch.nn.functional.pad(rows_at, (0, padded - rows_at.shape[0]), value=-1)
        half = self.buffer.shape[0] // 2  # transformers' buffer has an even number of pages (K and V of each)
        halves = self.buffer[:half], self.buffer[half:]
        flats = [h.view(-1, *h.shape[2:]) for h in halves]
        size = flats[0].shape[0]
        for second in (False, True):
            mine = (rows_at >= size) if second else ((rows_at >= 0) & (rows_at < size))
            slot_mapping = torch.where(mine, rows_at - size * second, -1)
            # the other half's rows at these slots as they are now (after the first call, for the second)
            current = flats[not second].index_select(0, slot_mapping.clamp(min=0))
            key, value = (current, rows) if second else (rows, current)
            kv_cache_ops.reshape_and_cache_flash(key, value, *halves, slot_mapping)

    # --------------------------------------------------------------------------------------------------- fallback
    def gather_window(self, k, v):
        """The window's K/V [sum of kv lens, kv_heads, D] at transformers' read indices, read before the write, the
        new tokens at the sentinel slots (a sliding layer's ring that the step's write would overwrite)."""
        if self.read_index.numel() == 0:  # no request has a past: the context is the new tokens
            return k, v
        flat = self.buffer.view(-1, *self.buffer.shape[2:])
        sentinel = (self.read_index == self.allocator.sentinel_index)[:, None, None]
        gathered = []
        for new, first in ((k, 2 * self.layer * self.page), (v, (2 * self.layer + 1) * self.page)):
            rows = flat[first:].index_select(0, self.read_index)
            gathered.append(rows.masked_scatter(sentinel, new))
        return gathered
