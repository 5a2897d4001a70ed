"""One profile per TPU generation: everything a generation implies, in one record.

The device catalog (`core/devices.py`) derives slices from a profile's catalog rule; the JobSet
renderer loads the launch template it names; the trainer picks splash attention's blocks from it and
recognises its chips by the `device_kind` JAX reports; preflight judges a step against its compiler
HBM; the pods and preflight get its XLA flags (`core/xla_flags.py`). Nothing else keeps a table per
generation, so a new generation is one profile here, one launch template and their tests.
GPU machine types (XPK's names) are profiles too (`GPU_MACHINES`): a node's facts and its XLA flags,
taken N nodes at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3

# The sub-cube topologies a generation offers unless its profile says otherwise; larger slices are
# whole 4x4x4 cubes.
SUB_CUBE_TOPOLOGIES = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")
# Splash attention's (block_q, block_kv, block_kv_compute) where a generation has no measured set:
# MaxText's default.
DEFAULT_SPLASH_BLOCKS = (512, 512, 512)


# MaxText's flag sets of the same names (benchmarks/xla_flags_library.py), shared by several profiles.
# Continuation fusion: FSDP's all-gathers run asynchronously, fused with and overlapped by the matmuls
# that consume them, over several steps.
CF_FOR_ALL_GATHER = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
)
# Data-parallel overlap: optimise and pipeline the DCN all-reduces of data-parallel (hybrid mesh,
# multislice) gradients, also when they differ in size.
DATA_PARALLEL_OVERLAP = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
    "--xla_tpu_data_parallel_opt_different_sized_ops=true",
)


@dataclass(frozen=True)
class Generation:
    name: str  # the generation, and its device-name prefix unless `prefix` says: `tpu7x` in `tpu7x-128`
    # Catalog rule: a slice of C chips has C x devices_per_chip JAX devices on C / chips_per_vm VMs.
    devices_per_chip: int
    # Most 4x4x4 cubes in a slice named by its topology (XPK's `generate_tpu_topologies(max_cubes=N)`
    # for the generation's 4-chip machine type, src/xpk/core/system_characteristics.py).
    max_cubes: int
    accelerator_label: str  # cloud.google.com/gke-tpu-accelerator
    machine_type: str
    peak_tflops_per_chip: float  # dense bf16
    hbm_gib_per_chip: float
    # HBM the TPU compiler lets one program use per device, from its "exceeds available HBM (X)"
    # refusals; preflight judges a step against the smaller of this and the catalog's HBM per device.
    # None: the catalog's.
    compiler_hbm_gib: float | None
    # The `device_kind` strings JAX reports for the generation's devices.
    device_kinds: tuple[str, ...]
    # XLA/libtpu flags (`--name=value`), the pods' LIBTPU_INIT_ARGS before the recipe's and the site's.
    xla_flags: tuple[str, ...] = ()
    # Splash attention's (block_q, block_kv, block_kv_compute) for every pass (forward, dq, dkv).
    splash_blocks: tuple[int, int, int] = DEFAULT_SPLASH_BLOCKS
    chips_per_vm: int = 4
    sub_cube_topologies: tuple[str, ...] = SUB_CUBE_TOPOLOGIES
    # What a device name counts: TensorCores (`v5p-8` = 4 chips of 2) or, at one per chip, chips.
    tensorcores_per_chip: int = 2
    # The device-name prefix, where XPK's differs from the generation's name (`v5litepod-16` is v5e);
    # default the name.
    prefix: str = ""
    # A 2D-torus generation lists every slice shape it offers (XPK's `supported_topologies` for its
    # 4-chip machine type); empty: the 3D rule (the doubling rule, sub-cubes, whole cubes).
    topologies: tuple[str, ...] = ()
    # The machine type's vCPUs and memory (GiB) per VM, Google Cloud's TPU pages: the trainer
    # container's CPU and memory are sized from them (`core/node_resources.py`).
    vm_vcpus: int = 0
    vm_memory_gib: int = 0

    @property
    def device_prefix(self) -> str:
        return self.prefix or self.name

    # The launch template merged over `common.yaml`: a file of launch_templates/ (an absolute path
    # names one elsewhere); default `<name>.yaml`.
    template: str = ""

    @property
    def template_file(self) -> str:
        return self.template or f"{self.name}.yaml"

    @property
    def compiler_hbm_bytes(self) -> int | None:
        return None if self.compiler_hbm_gib is None else int(self.compiler_hbm_gib * GIB)


GENERATIONS: dict[str, Generation] = {
    # Ironwood: both TensorCores of a chip are JAX devices (no megacore).
    "tpu7x": Generation(
        name="tpu7x",
        devices_per_chip=2,
        max_cubes=144,
        accelerator_label="tpu7x",
        machine_type="tpu7x-standard-4t",
        peak_tflops_per_chip=2307.0,
        hbm_gib_per_chip=192.0,
        compiler_hbm_gib=94.75,  # libtpu 0.0.42.1: a little below the chip's HBM per TensorCore
        device_kinds=("TPU7x",),
        # SparseCore offload of the FSDP collectives (all-gather, 2D all-gather, reduce-scatter,
        # all-reduce): the case study credits Ironwood-specific flags like these with 41% -> 44.5% MFU,
        # loss-neutral. From MaxText benchmarks/xla_flags_library.py,
        # ENABLE_SPARSECORE_OFFLOADING_FOR_RS_AG_AR and ENABLE_SPARSECORE_OFFLOADING_BASE_FLAGS, plus
        # the 2D all-gather offload its Ironwood recipes add. Each one is documented in
        # docs/attention-and-xla-flags.md.
        xla_flags=(
            # The offloaded collectives are not fused into TensorCore async-collective fusions (either
            # continuation fusion or SparseCore offload handles a collective, not both).
            "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false",
            "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false",
            "--xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter=false",
            # Run all-gather (1D and 2D), reduce-scatter and all-reduce on the SparseCores, overlapping
            # the TensorCores' matmuls: FSDP's weight gathers and gradient reductions.
            "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
            "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true",
            "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
            "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
            # Name the offloaded collectives in profiles (no effect on the program).
            "--xla_tpu_enable_all_gather_offload_tracing=true",
            "--xla_tpu_enable_reduce_scatter_offload_tracing=true",
            "--xla_tpu_enable_all_reduce_offload_tracing=true",
            # Base flags SparseCore offload needs: TensorCore device shapes on the SparseCore, no
            # SparseCore instruction fusion, shared SparseCore memory, no megacore partitioning.
            "--xla_tpu_use_tc_device_shape_on_sc=true",
            "--xla_sc_enable_instruction_fusion=false",
            "--xla_sc_disjoint_spmem=false",
            "--xla_sc_disable_megacore_partitioning=true",
        ),
        # The largest blocks that compile for the 7B attention shape, fewest temporaries
        # (docs/attention-and-xla-flags.md, "Splash block sizes").
        splash_blocks=(2048, 2048, 512),
        vm_vcpus=224,  # tpu7x-standard-4t (docs.cloud.google.com/tpu/docs/tpu7x)
        vm_memory_gib=960,
    ),
    # v5p: the two TensorCores of a chip run as one megacore JAX device.
    "v5p": Generation(
        name="v5p",
        devices_per_chip=1,
        max_cubes=140,
        accelerator_label="tpu-v5p-slice",
        machine_type="ct5p-hightpu-4t",
        peak_tflops_per_chip=459.0,
        hbm_gib_per_chip=95.0,
        compiler_hbm_gib=95.74,  # libtpu 0.0.42.1
        # JAX names a v5p device `TPU v5` (its own tests tell v5p by that ending); `TPU v5p` too.
        device_kinds=("TPU v5", "TPU v5p"),
        # MaxText's v5p training configs (benchmarks/maxtext_v5p_model_configs.py) pass
        # CF_FOR_ALL_GATHER and DATA_PARALLEL_OVERLAP from benchmarks/xla_flags_library.py. Each one is
        # documented in docs/attention-and-xla-flags.md.
        xla_flags=CF_FOR_ALL_GATHER + DATA_PARALLEL_OVERLAP,
        # 2048 is refused by the v5p compiler (`CompileTimeScopedVmemOom`: the tiles do not fit the
        # scoped VMEM).
        splash_blocks=(1024, 1024, 512),
        vm_vcpus=208,  # ct5p-hightpu-4t (docs.cloud.google.com/tpu/docs/v5p)
        vm_memory_gib=448,
    ),
    # The v6e and v5e profiles: XPK's src/xpk/core/system_characteristics.py (AI-Hypercomputer/xpk) gives
    # their device names, topologies, TensorCores per chip, GKE accelerator labels and machine types (its
    # `get_tpu_system_characteristics_map` rows for `v6e` on ct6e-standard-4t and `v5litepod`); HBM and
    # peak bf16 FLOPs per chip are Google Cloud's TPU v6e and v5e system-architecture pages'.
    "v6e": Generation(
        # Trillium: one TensorCore per chip, a 2D torus; `v6e-N` counts chips.
        name="v6e",
        devices_per_chip=1,
        max_cubes=0,
        accelerator_label="tpu-v6e-slice",
        machine_type="ct6e-standard-4t",
        peak_tflops_per_chip=918.0,
        hbm_gib_per_chip=32.0,
        compiler_hbm_gib=None,
        device_kinds=("TPU v6 lite", "TPU v6e"),
        # MaxText's Trillium training configs for the 8B dense models (benchmarks/
        # maxtext_trillium_model_configs.py, llama3-8b-8192) pass DENSE_VMEM_LIMIT_FLAG (a larger
        # scoped VMEM for each op of a compute-bound model) and CF_FOR_ALL_GATHER from
        # benchmarks/xla_flags_library.py; documented in docs/attention-and-xla-flags.md.
        xla_flags=("--xla_tpu_scoped_vmem_limit_kib=98304", *CF_FOR_ALL_GATHER),
        tensorcores_per_chip=1,
        # XPK's v6e shapes on ct6e-standard-4t, 4 chips per VM (so `v6e-8` is 2 VMs); its single-chip
        # `v6e-1` is another machine type, ct6e-standard-1t, and not in this catalog.
        topologies=("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
        vm_vcpus=180,  # ct6e-standard-4t (docs.cloud.google.com/tpu/docs/v6e)
        vm_memory_gib=720,
    ),
    "v5e": Generation(
        # v5e (v5 lite): one TensorCore per chip, a 2D torus; XPK and GKE name its slices `v5litepod-N`
        # (N chips), libtpu its topologies `v5e:AxB`.
        name="v5e",
        devices_per_chip=1,
        max_cubes=0,
        accelerator_label="tpu-v5-lite-podslice",
        machine_type="ct5lp-hightpu-4t",
        peak_tflops_per_chip=197.0,
        hbm_gib_per_chip=16.0,
        compiler_hbm_gib=None,
        device_kinds=("TPU v5 lite", "TPU v5e"),
        # MaxText's v5e training configs (benchmarks/maxtext_v5e_model_configs.py) pass
        # DATA_PARALLEL_OVERLAP and CF_FOR_ALL_GATHER, v5p's set; documented in
        # docs/attention-and-xla-flags.md.
        xla_flags=CF_FOR_ALL_GATHER + DATA_PARALLEL_OVERLAP,
        tensorcores_per_chip=1,
        prefix="v5litepod",
        topologies=("2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
        vm_vcpus=112,  # ct5lp-hightpu-4t (docs.cloud.google.com/tpu/docs/v5e)
        vm_memory_gib=192,
    ),
}


@dataclass(frozen=True)
class GpuMachine:
    """A GKE GPU machine type, as XPK names it (its `device_type`): a node of `gpus_per_node` GPUs,
    taken N nodes at a time. No TPU topology: the catalog's device is the machine type and a node
    count (`core/devices.py`)."""

    name: str  # XPK's device type: `h100-mega-80gb-8`
    gpu: str  # the GPU, for people: `H100 80GB`
    gpus_per_node: int
    machine_type: str  # cloud.google.com/gce-machine-type
    accelerator_label: str  # cloud.google.com/gke-accelerator
    interconnect: str  # between nodes (XPK's `gpu_direct_name` in parentheses)
    peak_tflops_per_gpu: float  # dense bf16
    hbm_gib_per_gpu: float  # the GB NVIDIA and Google name; the plan keeps 15% of it spare
    # The pods' XLA_FLAGS (`core/xla_flags.py`): the field's published set for the machine type.
    xla_flags: tuple[str, ...] = ()
    # How the nodes' GPUs reach each other (XPK's `GpuConfig.gpu_direct_name`: tcpxo | rdma): it names
    # the launch template merged over `common.yaml` and `gpu.yaml` (`launch_templates/gpu-<it>.yaml`).
    gpu_direct: str = ""
    # The machine type's vCPUs and memory (GiB) per node, Compute Engine's accelerator-optimized
    # machine family page: the trainer container's CPU and memory are sized from them.
    vm_vcpus: int = 0
    vm_memory_gib: int = 0

    @property
    def template_file(self) -> str:
        return f"gpu-{self.gpu_direct}.yaml"


# XLA's GPU flags for data-parallel and FSDP training over NCCL, as the field publishes them per machine
# type: the latency-hiding scheduler overlapping collectives with compute, no Triton GEMMs (cuBLAS),
# large combine thresholds so the many small FSDP collectives go out as few large ones, the collectives
# pipelined across the layer loop (`lax.scan`: double-buffered), and no combining by dimension.
# A3 Mega: MaxText's A3 configs (src/maxtext/configs/gpu/a3/llama_2_7b/8vm.sh), with their
# `--xla_gpu_pipeline_*=on` spelled as XLA now names them (`--xla_gpu_enable_pipelined_*=true`: jaxlib
# 0.10.2 aborts on the old names, "Unknown flags in XLA_FLAGS") and without `--xla_gpu_enable_command_buffer=''`
# (an empty value; XLA's default command buffers are kept). A3 Ultra and A4: GoogleCloudPlatform's
# gpu-recipes for MaxText (training/a3ultra/llama3-1-70b and training/a4/llama3-1-70b, values.yaml),
# without A3 Ultra's `--xla_gpu_graph_level=0`, which XLA no longer knows. tests/test_gpu_xla_flags.py
# starts JAX with each set: every flag parses.
_GPU_OVERLAP = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_enable_all_gather_combine_by_dim=false",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
)
A3_MEGA_XLA_FLAGS = _GPU_OVERLAP + (
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=1073741824",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
)
A3_ULTRA_XLA_FLAGS = _GPU_OVERLAP + (
    "--xla_gpu_all_reduce_combine_threshold_bytes=2147483648",
    "--xla_gpu_all_gather_combine_threshold_bytes=2147483648",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=16777216",
    "--xla_disable_hlo_passes=rematerialization",
)
A4_XLA_FLAGS = A3_ULTRA_XLA_FLAGS + ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL",)


# XPK's GPU rows (src/xpk/core/system_characteristics.py at 367c8382: `device_type`, `gce_machine_type`,
# `gke_accelerator`, `chips_per_vm`, `GpuConfig.gpu_direct_name`); GPUs take resource `nvidia.com/gpu`.
# Peaks are NVIDIA's dense bf16 (without 2:4 sparsity): 989 TFLOP/s for H100 SXM and H200 (the same
# die, more and faster HBM); 2,250 for B200, NVIDIA's HGX B200 datasheet figure (4.5 PFLOP/s with
# sparsity), below the GB200 part's. HBM: 80 GB, 141 GB, and 180 GB for the B200 of HGX B200 and A4.
GPU_MACHINES: dict[str, GpuMachine] = {
    m.name: m
    for m in (
        GpuMachine(
            name="h100-mega-80gb-8",
            gpu="H100 80GB",
            gpus_per_node=8,
            machine_type="a3-megagpu-8g",
            accelerator_label="nvidia-h100-mega-80gb",
            interconnect="GPUDirect-TCPXO (tcpxo)",
            peak_tflops_per_gpu=989.0,
            hbm_gib_per_gpu=80.0,
            xla_flags=A3_MEGA_XLA_FLAGS,
            gpu_direct="tcpxo",
            vm_vcpus=208,
            vm_memory_gib=1872,
        ),
        GpuMachine(
            name="h200-141gb-8",
            gpu="H200 141GB",
            gpus_per_node=8,
            machine_type="a3-ultragpu-8g",
            accelerator_label="nvidia-h200-141gb",
            interconnect="RDMA over gIB (rdma)",
            peak_tflops_per_gpu=989.0,
            hbm_gib_per_gpu=141.0,
            xla_flags=A3_ULTRA_XLA_FLAGS,
            gpu_direct="rdma",
            vm_vcpus=224,
            vm_memory_gib=2952,
        ),
        GpuMachine(
            name="b200-8",
            gpu="B200 180GB",
            gpus_per_node=8,
            machine_type="a4-highgpu-8g",
            accelerator_label="nvidia-b200",
            interconnect="RDMA over gIB (rdma)",
            peak_tflops_per_gpu=2250.0,
            hbm_gib_per_gpu=180.0,
            xla_flags=A4_XLA_FLAGS,
            gpu_direct="rdma",
            vm_vcpus=224,
            vm_memory_gib=3968,
        ),
    )
}


def generation_names() -> str:
    """`tpu7x, v5p, v6e, v5e`: the generations, for messages and help."""
    return ", ".join(GENERATIONS)


def generation_of_device_kind(device_kind: str) -> str | None:
    """The generation whose profile names `device_kind` (`TPU7x` -> `tpu7x`), None for any other."""
    kind = device_kind.strip().lower()
    for gen in GENERATIONS.values():
        if kind in (k.lower() for k in gen.device_kinds):
            return gen.name
    return None


def splash_blocks_of(generation: str) -> tuple[int, int, int]:
    """Splash attention's blocks on `generation`; MaxText's default for one without a profile."""
    gen = GENERATIONS.get(generation)
    return gen.splash_blocks if gen is not None else DEFAULT_SPLASH_BLOCKS
