"""Does TorchTPU find the chip? A probe for the TPU test machine, after scripts/torch_tpu_parts.sh has installed torch
and torch-tpu there (its header has the device runs):

    export PYTHONPATH=$PWD/build/torch-site-libtpu:$PYTHONPATH:$PWD/build/torch-site
    python3 scripts/torch_tpu_probe.py [--no-jax-devices] [--step-timeout-s 240]

Prints the Python, glibc, torch, torch-tpu, jax, jaxlib and libtpu versions (and where libtpu.so comes from), the
environment TorchTPU and libtpu read (TPU_*, JAX_*, PJRT_*, LIBTPU_*, XLA_FLAGS, ...), what torch-tpu's PCI scan sees,
then runs, each step on its own with its full traceback on failure:

1. `import torch` (which autoloads torch-tpu's backend where its PCI scan finds a TPU) and `import torch_tpu`;
2. the `tpu` device: where the autoload did not set it up (the PCI scan found no TPU exposed through VFIO), the probe
   says so and sets it up itself, as the autoload would, and goes on;
3. a tensor to the chip and back, with arithmetic on the chip, compared with the CPU's result;
4. TorchTPU's `jax_op` (`torch.tpu.pallas.jax_op`, what the project's torch ops are made of) over a jnp function,
   and over a small Pallas kernel (compiled by Mosaic), each compared with the CPU's result;
5. (informational, last; `--no-jax-devices` skips it) jax in the same process: `jax.devices()` while torch-tpu holds
   the chip, which the project's kernels reach through `pltpu.get_tpu_info()` when they trace for the chip.

Exit status 0 when steps 1-4 passed, 1 otherwise (step 5 does not count; should it abort the process, the exit
status is not 0, but `REQUIRED STEPS PASSED` was printed before it). A step still running after --step-timeout-s
has every thread's stack printed and the process ended (exit 1).
"""

import argparse
import faulthandler
import importlib.metadata
import importlib.util
import os
import pathlib
import platform
import sys
import time
import traceback

ENV_PREFIXES = ("TPU_", "JAX_", "PJRT_", "LIBTPU_", "XLA_", "TORCH_", "PYTORCH_", "ALLOW_MULTIPLE_LIBTPU_LOAD")
ENV_NAMES = ("PYTHONPATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "CLOUDSDK_CONFIG", "HOSTNAME")


def say(*parts):
    print(*parts, flush=True)


def version_of(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def location_of(name):
    spec = importlib.util.find_spec(name)
    if spec is None:
        return "-"
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return spec.origin or "-"


def libtpu_copies():
    """Every libtpu.so on sys.path, in the order an `import libtpu` would find its package."""
    found = []
    for entry in sys.path:
        candidate = pathlib.Path(entry or ".") / "libtpu" / "libtpu.so"
        if candidate.is_file():
            found.append(str(candidate.resolve()))
    return found


def pci_view():
    """What torch-tpu's hardware scan reads: Google PCI devices (vendor 0x1ae0), their IOMMU group, /dev/vfio."""
    lines = []
    root = pathlib.Path("/sys/bus/pci/devices")
    try:
        entries = sorted(root.iterdir())
    except OSError as error:
        return [f"{root}: {error}"]
    google = 0
    for device in entries:
        try:
            vendor = (device / "vendor").read_text().strip()
        except OSError:
            continue
        if vendor != "0x1ae0":
            continue
        google += 1
        try:
            device_id = (device / "device").read_text().strip()
        except OSError as error:
            device_id = f"? ({error})"
        try:
            group = (device / "iommu_group").readlink().name
            vfio = pathlib.Path("/dev/vfio") / group
            group_text = f"iommu group {group}, {vfio} {'exists' if vfio.exists() else 'absent'}"
        except OSError as error:
            group_text = f"no iommu group ({error.strerror})"
        lines.append(f"{device.name}: vendor {vendor} device {device_id}, {group_text}")
    lines.insert(0, f"{root}: {len(entries)} devices, {google} with Google's vendor id 0x1ae0")
    for pattern in ("/dev/vfio/*", "/dev/accel*"):
        matches = sorted(str(p) for p in pathlib.Path("/").glob(pattern.lstrip("/")))
        lines.append(f"{pattern}: {' '.join(matches) or 'none'}")
    lockfile = pathlib.Path("/tmp/libtpu_lockfile")
    lines.append(f"{lockfile}: {'exists' if lockfile.exists() else 'absent'}")
    return lines


def print_environment(title):
    say(f"--- {title}")
    for name in sorted(os.environ):
        if name.startswith(ENV_PREFIXES) or name in ENV_NAMES:
            say(f"  {name}={os.environ[name]}")
    say(f"  sys.path: {sys.path}")
    say(f"  libtpu.so on sys.path, in order: {libtpu_copies() or 'none'}")
    for line in pci_view():
        say(f"  {line}")


class Steps:
    def __init__(self, timeout_s):
        self.timeout_s = timeout_s
        self.results = []  # (name, ok, required, seconds, note)

    def run(self, name, fn, required=True):
        say(f"=== {name}")
        if self.timeout_s > 0:
            faulthandler.dump_traceback_later(self.timeout_s, exit=True)
        start = time.perf_counter()
        try:
            note = fn()
            ok = True
        except BaseException as error:  # noqa: BLE001  (a probe reports whatever stopped a step)
            if isinstance(error, KeyboardInterrupt):
                raise
            ok = False
            note = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            say(f"FAILED: {name}")
            traceback.print_exc(file=sys.stdout)
            sys.stdout.flush()
            print_environment(f"environment at the failure of: {name}")
        finally:
            faulthandler.cancel_dump_traceback_later()
        seconds = time.perf_counter() - start
        self.results.append((name, ok, required, seconds, note))
        say(f"--- {name}: {'ok' if ok else 'FAILED'} ({seconds:.1f} s){': ' + str(note) if note else ''}")
        return ok

    def required_ok(self):
        return all(ok for _, ok, required, _, _ in self.results if required)

    def summary(self):
        say("=== summary")
        for name, ok, required, seconds, note in self.results:
            kind = "" if required else " (informational)"
            say(f"  {'ok    ' if ok else 'FAILED'} {name}{kind} [{seconds:.1f} s]{': ' + str(note) if note else ''}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-jax-devices", action="store_true", help="skip the informational jax.devices() step")
    parser.add_argument("--step-timeout-s", type=float, default=240.0, help="dump every stack and exit past this")
    args = parser.parse_args()

    say("=== versions")
    say(
        f"  python {platform.python_version()} ({sys.executable}), {platform.machine()}, {''.join(platform.libc_ver())}"
    )
    for package in ("torch", "torch-tpu", "jax", "jaxlib", "libtpu", "numpy"):
        module = {"torch-tpu": "torch_tpu"}.get(package, package)
        say(f"  {package} {version_of(package)} at {location_of(module)}")
    print_environment("environment")

    steps = Steps(args.step_timeout_s)
    state = {}

    def import_torch():
        import torch

        state["torch"] = torch
        autoloaded = "torch_tpu" in sys.modules
        import torch_tpu
        import torch_tpu._loader as loader

        state["loader"] = loader
        return (
            f"torch {torch.__version__}, torch_tpu from {os.path.dirname(torch_tpu.__file__)}; autoloaded: {autoloaded}"
            f", backend set up: {loader._DEVICE_INITIALIZED}; TPU_LIBRARY_PATH={os.environ.get('TPU_LIBRARY_PATH')}"
        )

    if not steps.run("1. import torch, torch_tpu", import_torch):
        steps.summary()
        return 1

    def device():
        torch, loader = state["torch"], state["loader"]
        from torch_tpu._internal.utils import hardware

        notes = [f"PCI scan: {hardware.get_tpu_device_count()} TPU(s), name {hardware.get_tpu_device_name()!r}"]
        if not loader._DEVICE_INITIALIZED:
            notes.append("the autoload did not set the backend up (PCI scan found no TPU): _init_device('tpu') here")
            say(f"  {notes[-1]}")
            loader._init_device("tpu")
        dev = torch.device("tpu")
        accelerator = torch.accelerator
        notes.append(
            f"device {dev!r}; torch.accelerator: {accelerator.current_accelerator()!r}, is_available "
            f"{accelerator.is_available()}, device_count {accelerator.device_count()}"
        )
        import libtpu

        notes.append(f"libtpu {getattr(libtpu, '__version__', '?')} from {os.path.dirname(libtpu.__file__)}")
        return "; ".join(notes)

    device_ok = steps.run("2. torch.device('tpu')", device)

    def round_trip():
        torch = state["torch"]
        x = torch.arange(8 * 128, dtype=torch.float32).reshape(8, 128) / 7.0
        on_chip = x.to("tpu")
        state["x"] = on_chip
        y = (on_chip * 2.0 + 1.0).sum(dim=0).cpu()
        expected = (x * 2.0 + 1.0).sum(dim=0)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-3)
        back = on_chip.cpu()
        assert torch.equal(back, x), "the tensor did not come back unchanged"
        return f"{on_chip.device}, {tuple(on_chip.shape)} {on_chip.dtype}, arithmetic matches the CPU"

    def jax_op_jnp():
        torch = state["torch"]
        import jax
        from torch.tpu.pallas import jax_op

        def probe_axpy(x: jax.Array, y: jax.Array) -> jax.Array:
            return x + 2.0 * y

        op = jax_op("torch_tpu_probe::axpy", probe_axpy)
        a = torch.randn(16, 256)
        b = torch.randn(16, 256)
        out = op(a.to("tpu"), b.to("tpu"))
        torch.testing.assert_close(out.cpu(), a + 2.0 * b, rtol=1e-5, atol=1e-5)
        return f"output on {out.device}, matches the CPU"

    def jax_op_pallas():
        torch = state["torch"]
        import jax
        from jax.experimental import pallas as pl
        from torch.tpu.pallas import jax_op

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 3.0 + 0.5

        def probe_pallas(x: jax.Array) -> jax.Array:
            return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

        op = jax_op("torch_tpu_probe::pallas_scale", probe_pallas)
        a = torch.randn(8, 128)
        out = op(a.to("tpu"))
        torch.testing.assert_close(out.cpu(), a * 3.0 + 0.5, rtol=1e-6, atol=1e-6)
        return f"Pallas kernel through jax_op: output on {out.device}, matches the CPU"

    if device_ok:
        if steps.run("3. tensor to the chip and back", round_trip):
            steps.run("4a. jax_op over a jnp function", jax_op_jnp)
            steps.run("4b. jax_op over a Pallas kernel", jax_op_pallas)
    passed = steps.required_ok()
    say("REQUIRED STEPS PASSED" if passed else "REQUIRED STEPS FAILED")

    if not args.no_jax_devices and device_ok:

        def jax_devices():
            import jax

            return f"jax backend {jax.default_backend()}, devices {jax.devices()}"

        steps.run("5. jax.devices() beside torch-tpu", jax_devices, required=False)
    steps.summary()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
