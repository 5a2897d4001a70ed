"""Whether an environment's JAX can use CUDA: run inside the GPU image by `make image-test VARIANT=gpu`
(`python -c` with this file's text, so the standard library only), or on a GPU machine,
`docker run --rm -i --gpus all IMAGE python - < tools/cuda_probe.py`.

It tells apart what a machine without a GPU must not confuse:
- the CUDA plugin missing or broken, which no node would fix: jax-cuda12-plugin or jax-cuda12-pjrt not
  installed, their modules not importing, or a CUDA library of their NVIDIA wheels not loading (each
  named, with the loader's own error);
- everything in the image loads and there is no GPU here: the driver (`libcuda.so.1`) is the node's,
  never the image's (GKE mounts it at /usr/local/nvidia/lib64), so where it is absent, or finds no
  device, `jax.devices('cuda')` cannot succeed and is not tried;
- a GPU: `jax.devices('cuda')`, which runs JAX's own check of the CUDA libraries' versions, and one
  matmul on it.

Prints one line of JSON (`report()`): plugin, libraries, driver, gpus, problems; exits 1 when there is
a problem.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys

PLUGIN = ("jax-cuda12-plugin", "jax-cuda12-pjrt")
PLUGIN_MODULES = ("jax_cuda12_plugin.cuda_plugin_extension", "jax_cuda12_plugin._versions")
PJRT = ("jax_plugins.xla_cuda12", "xla_cuda_plugin.so")
# (directory under site-packages/nvidia/, library, the wheel that brings it), in the order JAX's plugin
# loads them (jax_plugins/xla_cuda12: _load_nvidia_libraries), nvJitLink, which cuSPARSE, cuFFT and
# cuSOLVER link to, before them.
LIBRARIES = (
    ("cuda_runtime", "libcudart.so.12", "nvidia-cuda-runtime-cu12"),
    ("cuda_nvrtc", "libnvrtc.so.12", "nvidia-cuda-nvrtc-cu12"),
    ("cublas", "libcublas.so.12", "nvidia-cublas-cu12"),
    ("cublas", "libcublasLt.so.12", "nvidia-cublas-cu12"),
    ("nccl", "libnccl.so.2", "nvidia-nccl-cu12"),
    ("cuda_cupti", "libcupti.so.12", "nvidia-cuda-cupti-cu12"),
    ("nvjitlink", "libnvJitLink.so.12", "nvidia-nvjitlink-cu12"),
    ("cusparse", "libcusparse.so.12", "nvidia-cusparse-cu12"),
    ("cusolver", "libcusolver.so.11", "nvidia-cusolver-cu12"),
    ("cufft", "libcufft.so.11", "nvidia-cufft-cu12"),
    ("nvshmem", "libnvshmem_host.so.3", "nvidia-nvshmem-cu12"),
    ("cudnn", "libcudnn.so.9", "nvidia-cudnn-cu12"),
)
DRIVER = "libcuda.so.1"
CUDA_ERROR_NO_DEVICE = 100


def _dotted(n: int, scale: int) -> str:
    """A version CUDA's libraries report as one integer: 23203 with scale 100 is 2.32.3 (NCCL, cuDNN 9)."""
    return f"{n // (scale * scale)}.{n // scale % scale}.{n % scale}"


def _version(handle: ctypes.CDLL, library: str) -> str | None:
    """The version a loaded library reports of itself (none of these calls needs a GPU)."""
    value = ctypes.c_int()
    if library.startswith("libcudart."):
        ok = handle.cudaRuntimeGetVersion(ctypes.byref(value)) == 0  # 12090: 12.9
        return f"{value.value // 1000}.{value.value % 1000 // 10}" if ok else None
    if library.startswith("libnccl."):
        ok = handle.ncclGetVersion(ctypes.byref(value)) == 0
        return _dotted(value.value, 100) if ok else None
    if library.startswith("libcudnn."):
        handle.cudnnGetVersion.restype = ctypes.c_size_t
        return _dotted(int(handle.cudnnGetVersion()), 100)
    if library.startswith("libcublas."):
        parts = []
        for prop in (0, 1, 2):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            if handle.cublasGetProperty(prop, ctypes.byref(value)) != 0:
                return None
            parts.append(str(value.value))
        return ".".join(parts)
    return None


def load_libraries() -> tuple[list[dict], list[str]]:
    """Each CUDA library loaded from its NVIDIA wheel, as JAX's plugin loads it: (records, problems)."""
    records: list[dict] = []
    not_installed: list[str] = []
    problems: list[str] = []
    for directory, library, wheel in LIBRARIES:
        spec = importlib.util.find_spec("nvidia") and importlib.util.find_spec(f"nvidia.{directory}")
        record: dict = {"library": library, "wheel": wheel, "path": None, "version": None, "error": None}
        records.append(record)
        if not spec or not spec.submodule_search_locations:
            record["error"] = "not installed"
            not_installed.append(f"{library} ({wheel})")
            continue
        path = os.path.join(list(spec.submodule_search_locations)[0], "lib", library)
        record["path"] = path
        try:
            handle = ctypes.CDLL(path)
        except OSError as e:
            record["error"] = str(e)
            problems.append(f"{library} does not load: {e}")
            continue
        try:
            record["version"] = _version(handle, library)
        except AttributeError as e:  # the library lacks the call: it loads, its version is unknown
            record["error"] = str(e)
    if not_installed:
        problems.insert(0, f"{len(not_installed)} CUDA libraries not installed: {', '.join(not_installed)}")
    return records, problems


def plugin() -> tuple[dict, list[str]]:
    """The plugin's distributions and whether its modules import and its PJRT library loads."""
    versions: dict = {}
    problems: list[str] = []
    for name in PLUGIN:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
            problems.append(f"{name} is not installed")
    if problems:
        return versions, problems
    for module in PLUGIN_MODULES:
        try:
            importlib.import_module(module)
        except Exception as e:
            problems.append(f"{module} does not import: {type(e).__name__}: {e}")
    package, library = PJRT
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        problems.append(f"{package} is not installed")
    else:
        try:
            ctypes.CDLL(os.path.join(list(spec.submodule_search_locations)[0], library))
        except OSError as e:
            problems.append(f"{package}'s {library} does not load: {e}")
    return versions, problems


def driver() -> dict:
    """The node's CUDA driver: whether it loads, and how many devices it sees."""
    try:
        cuda = ctypes.CDLL(DRIVER)
    except OSError as e:
        return {
            "library": None,
            "devices": 0,
            "error": f"{DRIVER} (the node's CUDA driver) is absent",
            "why": str(e),
        }
    code = cuda.cuInit(0)
    if code != 0:
        name = ctypes.c_char_p()
        cuda.cuGetErrorName(code, ctypes.byref(name))
        text = (name.value or b"").decode() or str(code)
        no_device = code == CUDA_ERROR_NO_DEVICE
        return {"library": DRIVER, "devices": 0, "error": f"cuInit: {text}", "no_device": no_device}
    count = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(count))
    return {"library": DRIVER, "devices": count.value, "error": None}


def gpus() -> tuple[list[str], list[str]]:
    """jax.devices('cuda') and one matmul on the first: (device kinds, problems)."""
    try:
        import jax
        import jax.numpy as jnp

        devices = jax.devices("cuda")
        x = jax.device_put(jnp.ones((256, 256), jnp.float32), devices[0])
        total = float((x @ x).sum())
        if total != 256.0**3:
            return [d.device_kind for d in devices], [f"a 256x256 matmul on {devices[0]} summed to {total}"]
        return [d.device_kind for d in devices], []
    except Exception as e:
        last = str(e).strip().splitlines()[-1:] or [""]
        return [], [f"jax.devices('cuda'): {type(e).__name__}: {last[0]}"]


def report() -> dict:
    """Everything above, in one object; `problems` empty when the image can use a GPU it is given."""
    libraries, lib_problems = load_libraries()  # first: the plugin's modules link to them
    versions, plugin_problems = plugin()
    out: dict = {
        "plugin": versions,
        "libraries": libraries,
        "driver": None,
        "gpus": [],
        "problems": plugin_problems + lib_problems,
    }
    if out["problems"]:
        return out  # no driver is of use to a broken plugin
    out["driver"] = driver()
    if out["driver"]["error"] is None and out["driver"]["devices"] > 0:
        out["gpus"], problems = gpus()
        out["problems"] += problems
    elif (
        out["driver"]["error"] is not None and out["driver"]["library"] and not out["driver"].get("no_device")
    ):
        out["problems"].append(out["driver"]["error"])  # a driver that is there and fails
    return out


def main() -> int:
    r = report()
    print(json.dumps(r))
    return 1 if r["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
