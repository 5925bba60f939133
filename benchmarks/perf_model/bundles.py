"""Parse the TPU compiler's bundle dumps of one Mosaic kernel.

Format (libtpu 0.0.50.1, `--xla_jf_dump_to`), one bundle per line, e.g.

    "  0x5 LB: > { %s1 = sadd.s32 ... ;; %2 = vst ... } /* comment */"

address (hex, or "0"), an optional control marker (LB: loop body start, LH, LE,
PB, PF: predicated-region fall-through, CT), one '>' per enclosing loop, then the
instructions separated by ';;'. Comments may span several lines (DMA descriptors,
bounds checks); continuation lines do not start with an address.

Two schedules are dumped per kernel:
  *-packed-bundles-post-ra.txt  the schedule before the "delay converter" pass. It
      still holds the empty bundles the scheduler inserted to wait for a unit (for
      example a vmatmul issued every 8 bundles on one v6e MXU). This is the cycle
      count the compiler itself uses (its hlo-static-bundle-profile denominators
      equal this bundle count), so the model counts cycles here. Branches read
      "sbr.rel (%p) target bundleno = 247 (0xf7), region = 40".
  *-final_bundles.txt  after the delay converter: the waiting empty bundles are
      gone (the hardware stalls instead), so it is shorter than the real run time
      of MXU-bound code. Reported for reference ("final_bundles").

Every branch has 4 delay slots (bundles after the sbr that execute either way);
the model infers the count from the loop back-edge and falls back to 4.
"""

from __future__ import annotations

import dataclasses
import re

_ADDR_RE = re.compile(r"^\s*(0x[0-9a-fA-F]+|0)\s+(?:(LB|LH|LE|PB|PF|CT):\s*|:\s*)(>*)\s*\{(.*)$")
_BRANCH_RE = re.compile(r"sbr\.rel\s*(\((!?)%(\w+)\))?\s*target bundleno = (\d+)")
_EXIT_PRED_RE = re.compile(r"(%p\w+)\s*=\s*scmp\.\w+\.s32\.totalorder[^;]*?loop exit test")
_EXIT_RE = re.compile(r"scmp\.(ge|gt|lt|le|eq|ne)\.s32\.totalorder\s+(%\w+),\s*(-?\d+)\s*/\*\s*loop exit test")
_MXU_RE = re.compile(r"\bvmatmul\.[\w.]*")
# "dma.hbm_to_vmem [thread:$0]  (!%p6), /*hbm=*/%s4, /*size_in_granules=*/98304, ..." (the predicate is optional)
_DMA_RE = re.compile(r"=\s*dma\.(hbm|vmem|smem)_to_(hbm|vmem|smem)\b(?:\s*\[thread:[^\]]*\])?\s*(\(!?%p\w+\))?")
_GRANULES_RE = re.compile(r"size_in_granules=\*/(\d+)")
_WINDOW_RE = re.compile(r"window_bounds: \(([\d, ]+)\)")
_ELEM_RE = re.compile(r"element_size_in_bytes: (\d+)")
# Bytes per DMA granule: wherever a DMA carries a descriptor, window_bounds x element_size_in_bytes equals its
# size_in_granules x 32 (e.g. a 1 x 96 x 16 window of 2048-byte elements is 98304 granules; a 512-byte SMEM tile is
# 16); a DMA with no descriptor (some SMEM copies) is sized from its granules.
DMA_GRANULE_BYTES = 32

DEFAULT_DELAY_SLOTS = 4
# How the schedule names an output operand XLA placed in VMEM (e.g. "output window allocation for operator output 0.
# The window shape is bf16[4,16,128], while the full shape is bf16[4,64,128]"), on the load of its address.
_OUTPUT_WINDOW = "output window allocation for operator output"


@dataclasses.dataclass
class Bundle:
    addr: int
    marker: str  # "", "LB", "PF", ...
    depth: int  # number of enclosing loops ('>' count)
    text: str  # instructions (+ comments), continuation lines joined

    @property
    def empty(self) -> bool:
        return self.text.strip().startswith("}")

    def branch(self):
        """(target, predicated) for an sbr.rel in this bundle, else None."""
        m = _BRANCH_RE.search(self.text)
        if not m:
            return None
        return int(m.group(4)), m.group(1) is not None

    def exit_trip(self):
        m = _EXIT_RE.search(self.text)
        if not m:
            return None
        op, n = m.group(1), int(m.group(3))
        return n + 1 if op == "gt" else n

    def exit_register(self) -> str | None:
        """The induction variable the loop's exit test compares."""
        m = _EXIT_RE.search(self.text)
        return m.group(2) if m else None

    def mxu_ops(self) -> list[str]:
        return _MXU_RE.findall(self.text)

    def dmas(self) -> list[Dma]:
        """Each DMA started in this bundle."""
        out = []
        for part in self.text.split(";;"):
            m = _DMA_RE.search(part)
            if not m:
                continue
            w, e, g = _WINDOW_RE.search(part), _ELEM_RE.search(part), _GRANULES_RE.search(part)
            nbytes = None
            if w and e:
                nbytes = int(e.group(1))
                for d in w.group(1).split(","):
                    nbytes *= int(d)
            elif g:
                nbytes = int(g.group(1)) * DMA_GRANULE_BYTES
            predicate = (m.group(3) or "")[1:-1]
            out.append(Dma(self.addr, self.depth, m.group(1), m.group(2), nbytes, predicate))
        return out


@dataclasses.dataclass(frozen=True)
class Dma:
    """One DMA instruction of the schedule."""

    addr: int
    depth: int  # loops around its bundle ('>' count)
    source: str  # "hbm" | "vmem" | "smem"
    dest: str
    nbytes: int | None  # None: neither a descriptor nor a granule count to size it
    predicate: str = ""  # e.g. "!%p6_p2": issued under it, so it may not run every time its bundle does

    @property
    def predicated(self) -> bool:
        return bool(self.predicate)

    @property
    def touches_hbm(self) -> bool:
        return "hbm" in (self.source, self.dest)


def parse_bundles(text: str, *, dense: bool = True) -> list[Bundle]:
    """The bundles of a dump, continuation lines joined to their bundle. dense: addresses must be 0..n-1 (the cycle
    arithmetic of `analyze` indexes bundles by address)."""
    bundles: list[Bundle] = []
    for line in text.splitlines():
        m = _ADDR_RE.match(line)
        if m:
            bundles.append(Bundle(int(m.group(1), 16), m.group(2) or "", len(m.group(3)), m.group(4)))
        elif bundles:
            bundles[-1].text += "\n" + line
    for i, b in enumerate(bundles if dense else ()):
        if b.addr != i:
            raise ValueError(f"bundle addresses are not dense at index {i} (addr {b.addr:#x})")
    return bundles


@dataclasses.dataclass
class Region:
    """A forward conditional branch inside the grid loop: the bundles it skips."""

    branch_addr: int
    target: int
    skipped: int  # bundles not executed when the branch is taken (the inner loops in it at their static trips)


@dataclasses.dataclass
class KernelSchedule:
    """Cycle structure of one kernel from its pre-delay (or final) schedule."""

    total_bundles: int
    prologue: int  # bundles before the grid loop
    epilogue: int  # bundles after the grid loop
    body: int  # grid-loop body bundles (all regions executed, inner loops x trips)
    trip_count: int  # grid-loop iterations (grid steps + pipeline stages); 1 if not static
    has_loop: bool
    trip_count_static: bool  # False: the loop bound is a run-time value (a grid sized from scalar prefetch)
    delay_slots: int
    guard: Region | None  # pipeline fill/drain guard
    conds: list[Region]  # kernel-level conditional regions (pl.when), program order
    output_copies: list[int]  # indices in `conds` of regions that copy an output block into an output XLA placed in
    # VMEM (the pipeline's write-back as vector loads and stores, no DMA: a branch the kernel has no pl.when for)
    pipeline_regions: list[Region]  # conditional regions outside the guard: the pipeline's DMA issue, every step
    inner_loops: list[tuple[int, int, int | None]]  # (start, end, trip) of loops nested in the body; trip None:
    # not in the schedule (a run-time bound), counted once
    loop_regions: list[tuple[int, Region]]  # forward branches inside inner loops: (index of the innermost loop in
    # inner_loops, the region), address order; counted as run at every iteration unless the caller knows better
    mxu_ops_body: list[tuple[int, str]]  # (addr, opcode) of vmatmul in the body
    dmas: list[Dma]  # every DMA of the schedule, in address order (one issued in a loop's delay slots under the
    # loop's exit test runs once, after the loop: it is listed unpredicated)
    loop_span: tuple[int, int]  # [start, end) of the grid loop (the whole schedule when there is no grid loop)
    loop_depths: dict[int, int]  # start address of each inner loop -> its depth ('>' count of its first bundle)
    warnings: list[str]

    @property
    def unsized_loops(self) -> list[int]:
        """Start addresses of the inner loops whose trip count the schedule does not give (each counted once)."""
        return [t for t, _, trip in self.inner_loops if trip is None]

    @property
    def dmas_body(self) -> list[Dma]:
        return [d for d in self.dmas if self.dma_section(d) == "body"]

    def dma_section(self, dma: Dma) -> str:
        """ "prologue" (before the grid loop: once per kernel), "body" (once per grid step) or "epilogue"."""
        start, end = self.loop_span
        return "prologue" if dma.addr < start else "body" if dma.addr < end else "epilogue"

    def dma_repeats(self, dma: Dma) -> int | None:
        """Times `dma` runs per grid step (per kernel outside the grid loop): the trips of the inner loops around it;
        None when one of those has no trip count in the schedule."""
        n = 1
        for t, e, trip in self.inner_loops:
            # The back-edge's delay slots lie in [t, e) but are outside the loop when their depth says so.
            if t <= dma.addr < e and dma.depth >= self.loop_depths.get(t, 0):
                if trip is None:
                    return None
                n *= trip
        return n

    def step_cycles(self, skipped_conds: list[bool] | None = None) -> int:
        """Cycles of one steady grid step; skipped_conds[i] True = cond region i skipped."""
        c = self.body
        if skipped_conds is not None:
            for r, s in zip(self.conds, skipped_conds):
                if s:
                    c -= r.skipped
        return c

    def fill_cycles(self) -> int:
        """Cycles of one pipeline fill/drain iteration (guard taken)."""
        return self.body - (self.guard.skipped if self.guard else 0)

    def mxu_ops_in(self, skipped_conds: list[bool] | None = None) -> list[str]:
        ops = []
        for addr, op in self.mxu_ops_body:
            if skipped_conds is not None and any(
                s and r.branch_addr < addr < r.target for r, s in zip(self.conds, skipped_conds)
            ):
                continue
            ops.append(op)
        return ops


def _inner_trip(loop: list[Bundle]) -> int | None:
    """An inner loop's trip count from its exit test: the bound over the induction variable's step (an unrolled
    fori_loop adds its unroll factor each iteration), counted from 0; None when the bound is not an immediate."""
    bound = register = None
    for b in loop:
        if b.exit_trip() is not None:
            bound, register = b.exit_trip(), b.exit_register()
    if bound is None:
        return None
    step_re = re.compile(rf"{re.escape(register)} = sadd\.s32 (?:(\d+), %\w+|%\w+, (\d+))(?!\w)")
    for b in loop:
        m = step_re.search(b.text)
        if m:
            step = int(m.group(1) or m.group(2))
            return -(-bound // step) if step > 0 else bound
    return bound


def _infer_delay_slots(bundles: list[Bundle], backedge: int) -> int:
    for j in range(backedge + 1, min(len(bundles), backedge + 12)):
        if bundles[j].depth == 0 and not bundles[j].empty:
            return j - backedge - 1
    return DEFAULT_DELAY_SLOTS


def analyze(bundles: list[Bundle], has_grid: bool = True) -> KernelSchedule:
    """has_grid=False (a pallas_call with no grid): there is no grid loop, every loop is an inner loop of the one
    step (e.g. scalar fori_loops), counted trip times."""
    n = len(bundles)
    warnings: list[str] = []
    branches = []  # (src, target, predicated)
    for b in bundles:
        br = b.branch()
        if br is not None:
            branches.append((b.addr, br[0], br[1]))
    # Outer (grid) loop: the back-edge whose target is the first LB at depth 1.
    lb = [b.addr for b in bundles if b.marker == "LB" and b.depth == 1]
    outer = None
    if lb and has_grid:
        start = lb[0]
        backs = [(s, t) for s, t, _ in branches if t == start and s > t]
        if backs:
            outer = (start, max(s for s, _ in backs))
    if outer is None:
        delay = DEFAULT_DELAY_SLOTS
        start, end = 0, n  # whole program is one "step"
        prologue = epilogue = 0
        trip = 1
        trip_static = True
    else:
        start, back = outer
        delay = _infer_delay_slots(bundles, back)
        end = back + 1 + delay
        prologue, epilogue = start, n - end
        trip = None
        for b in bundles[start:end]:
            if b.depth == 1 and b.exit_trip() is not None:
                trip = b.exit_trip()
        # No compare against an immediate: the bound is a register (dynamic grid); the caller supplies the steps.
        trip_static = trip is not None
        trip = trip or 1
    # Inner loops: back-edges strictly inside the body.
    inner = []
    for s, t, _ in branches:
        if start <= t < s < end and (outer is None or (t, s) != (start, outer[1])) and t != start:
            iend = min(s + 1 + delay, end)
            inner.append((t, iend, _inner_trip(bundles[t:iend])))

    # Forward conditional branches inside the body, not inside an inner loop.
    def in_inner(a):
        return any(t <= a < e for t, e, _ in inner)

    fwd = [(s, t) for s, t, _ in branches if start <= s < t <= end and not in_inner(s)]
    loop_regions = []
    for s_, t_, _ in branches:
        around = [i for i, (lt, le, _) in enumerate(inner) if lt <= s_ < le]
        if not around or t_ <= s_:
            continue
        i = min(around, key=lambda k: inner[k][1] - inner[k][0])  # the innermost loop around the branch
        lt, le, _ = inner[i]
        if t_ <= le - (delay + 1):  # inside the loop (not its exit, not past its back-edge)
            loop_regions.append((i, Region(s_, t_, max(0, t_ - (s_ + 1 + delay)))))

    # A grid-level region skips the inner loops inside it at every trip they would have run (the body counts them
    # so): a fill/drain iteration's guard skips the whole step, token loops and all.
    def repeats(lo, hi):  # bundles of the inner loops in [lo, hi) run beyond their one pass in the code
        return sum((le - lt) * ((lt_trip or 1) - 1) for lt, le, lt_trip in inner if lo <= lt and le <= hi)

    def skipped(s, t):
        first = s + 1 + delay
        return max(0, t - first) + repeats(first, t)

    regions = [Region(s, t, skipped(s, t)) for s, t in fwd]
    guard, pipeline_regions = None, []
    if outer is not None and regions:
        # The guard is the branch that skips most of the body; it need not come first: a block fetched once (a fixed
        # BlockSpec: norm weights, a table) puts its conditional DMA issue before it. Regions inside it are pl.when
        # bodies; regions outside it are the pipeline's own (the DMA issue of blocks whose index changes), not
        # pl.whens: they run on fill/drain iterations too and are counted at every step.
        def extent(r):  # the region's bundles in the code, whatever its loops' trips
            return max(0, r.target - (r.branch_addr + 1 + delay))

        largest = max(regions, key=extent)
        others = [r for r in regions if r is not largest]
        encloses = all(largest.branch_addr < r.branch_addr and r.target <= largest.target for r in others)
        if extent(largest) > 0.5 * (end - start) or (others and largest is regions[0] and encloses):
            guard = largest
            regions = [r for r in others if largest.branch_addr < r.branch_addr and r.target <= largest.target]
            pipeline_regions = [r for r in others if r not in regions]
    # The pipeline's write-back to an output in VMEM names the output's allocation in its code ("output window
    # allocation for operator output N"); the kernel's own code writes the block buffer, which is not named so.
    output_copies = [
        k
        for k, r in enumerate(regions)
        if any(_OUTPUT_WINDOW in b.text for b in bundles[r.branch_addr : r.target])
        and not any(b.mxu_ops() for b in bundles[r.branch_addr : r.target])
    ]
    body = end - start + repeats(start, end)
    mxu = [(b.addr, op) for b in bundles[start:end] for op in b.mxu_ops()]
    return KernelSchedule(
        total_bundles=n,
        prologue=prologue,
        epilogue=epilogue,
        body=body,
        trip_count=trip,
        trip_count_static=trip_static,
        has_loop=outer is not None,
        delay_slots=delay,
        guard=guard,
        conds=regions,
        output_copies=output_copies,
        pipeline_regions=pipeline_regions,
        inner_loops=inner,
        loop_regions=loop_regions,
        mxu_ops_body=mxu,
        dmas=_dmas(bundles),
        loop_span=(start, end),
        loop_depths={t: bundles[t].depth for t, _, _ in inner},
        warnings=warnings,
    )


def _dmas(bundles: list[Bundle]) -> list[Dma]:
    """Every DMA; one predicated on a loop's exit test (compare "... /* loop exit test */") runs once, on the exit."""
    exits = {m.group(1) for b in bundles for m in _EXIT_PRED_RE.finditer(b.text)}
    out = []
    for b in bundles:
        for d in b.dmas():
            out.append(dataclasses.replace(d, predicate="") if d.predicate in exits else d)
    return out


def final_schedule_summary(text: str) -> dict:
    """Loop structure of the final (post delay-converter) schedule, for reporting."""
    bundles = parse_bundles(text, dense=False)
    lb = [b.addr for b in bundles if b.marker == "LB" and b.depth == 1]
    trip = None
    last_in_loop = None
    for b in bundles:
        if b.depth >= 1:
            last_in_loop = b.addr
        if b.depth == 1 and b.exit_trip() is not None:
            trip = b.exit_trip()
    body = None
    if lb and last_in_loop is not None:
        body = last_in_loop - lb[0] + 1 + DEFAULT_DELAY_SLOTS
    return {
        "total_bundles": len(bundles),
        "loop_body_bundles": body,
        "trip_count": trip,
        "prologue_bundles": lb[0] if lb else None,
    }
