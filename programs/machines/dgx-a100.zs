# An NVIDIA DGX A100 (80 GB) node for zdsl plan: 8 A100 SXM4 80GB on NVSwitch, one HDR InfiniBand
# port per GPU. Published peak figures, one rank per GPU: a plan with them is what the hardware
# allows, not what a run reaches (nccl-tests' bus bandwidth is about 3/4 of the NVLink figure, a
# model's compute some 40-60% of the tensor cores' peak); zdsl calibrate on the node measures them.
# Use: include "machines/dgx-a100.zs" beside `ranks N on cuda, 8 per node`.
#
# Sources:
#   NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16/FP16 tensor 312 TFLOPS dense,
#     TF32 156 TFLOPS dense; HBM2e 80 GB at 2,039 GB/s; NVLink 600 GB/s (bidirectional: 300 GB/s
#     each way); PCIe Gen4 64 GB/s (32 GB/s each way).
#   NVIDIA DGX A100 datasheet: 8x A100 80GB, 6 NVSwitches; 8 single-port ConnectX-6 VPI HDR
#     InfiniBand 200 Gb/s for compute (one per GPU: 25 GB/s each way); 2 AMD EPYC 7742.
#   AMD EPYC 7742: 8 channels of DDR4-3200 per socket (204.8 GB/s): 409.6 GB/s a node, 51 GB/s a
#     GPU's share, which prices an optimizer step offloaded to the host.
# The link statement gives each level (bytes a second each rank moves, seconds per collective):
# within the node and across nodes. The latencies are not datasheet figures: the order of NCCL's
# small-message time within a node (NVSwitch) and across nodes (InfiniBand), as nccl-tests reports.
machine cuda(
    flops=3.12e14,                       # bf16 tensor peak, also where no table applies
    flops_widths=(4096),                 # one width: the peak at every width
    flops_fp32=(1.56e14),                # TF32 tensor cores
    flops_bf16=(3.12e14),
    flops_fp16=(3.12e14),
    memory_bw=2.039e12,                  # HBM2e
    host_memory_bw=5.12e10,              # the GPU's share of the host's DDR4
    pcie=3.2e10,                         # PCIe Gen4 x16, each way
    comm_slots=1                         # NCCL: one stream per communicator
)
link node=(3.0e11, 1.0e-5),              # NVLink 3 through NVSwitch, each way
     cluster=(2.5e10, 2.0e-5)            # HDR InfiniBand 200 Gb/s per GPU, each way
memory device 80GB                       # HBM2e per GPU (80e9 bytes: under the 80 GiB, room for CUDA's own)
