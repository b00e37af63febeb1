# An NVIDIA DGX H100 node for zdsl plan: 8 H100 SXM5 80GB on NVSwitch, one NDR InfiniBand port per
# GPU. Published peak figures, one rank per GPU: a plan with them is what the hardware allows, not
# what a run reaches (nccl-tests' bus bandwidth is about 3/4 of the NVLink figure, a model's compute
# some 40-60% of the tensor cores' peak); zdsl calibrate on the node measures them.
# Use: include "machines/dgx-h100.zs" beside `ranks N on cuda, 8 per node`.
#
# Sources:
#   NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16/FP16 tensor 989 TFLOPS dense (1,979
#     with sparsity), TF32 494 TFLOPS dense; HBM3 80 GB at 3.35 TB/s; NVLink 900 GB/s
#     (bidirectional: 450 GB/s each way); PCIe Gen5 128 GB/s (64 GB/s each way).
#   NVIDIA DGX H100 datasheet: 8x H100 80GB, 4 NVSwitches; 8 ConnectX-7 ports of 400 Gb/s
#     InfiniBand/Ethernet for compute (one per GPU: 50 GB/s each way); 2 Intel Xeon Platinum 8480C.
#   Intel Xeon Platinum 8480C: 8 channels of DDR5-4800 per socket (307 GB/s): 614 GB/s a node,
#     77 GB/s a GPU's share, which prices an optimizer step offloaded to the host.
# The link statement gives each level (bytes a second each rank moves, seconds per collective):
# within the node and across nodes. The latencies are not datasheet figures: the order of NCCL's
# small-message time within a node (NVSwitch) and across nodes (InfiniBand), as nccl-tests reports.
machine cuda(
    flops=9.89e14,                       # bf16 tensor peak, also where no table applies
    flops_widths=(4096),                 # one width: the peak at every width
    flops_fp32=(4.94e14),                # TF32 tensor cores
    flops_bf16=(9.89e14),
    flops_fp16=(9.89e14),
    memory_bw=3.35e12,                   # HBM3
    host_memory_bw=7.68e10,              # the GPU's share of the host's DDR5
    pcie=6.4e10,                         # PCIe Gen5 x16, each way
    comm_slots=1                         # NCCL: one stream per communicator
)
link node=(4.5e11, 1.0e-5),              # NVLink 4 through NVSwitch, each way
     cluster=(5.0e10, 2.0e-5)            # NDR InfiniBand 400 Gb/s per GPU, each way
memory device 80GB                       # HBM3 per GPU (80e9 bytes: under the 80 GiB, room for CUDA's own)
