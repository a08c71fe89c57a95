"""The closed choices of the configs (backend, precision, schedule, ...) as enums: OmegaConf
rejects any other value at compose time, listing these."""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A closed set of string values: OmegaConf rejects any other at compose time, listing
    these. Members are their own strings (==, dict keys, f-strings, json, sqlite)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


def _choice(name: str, *values: str) -> type[Choice]:
    # The functional form: OmegaConf looks members up by name, and "1f1b" is no identifier.
    return Choice(name, [(v, v) for v in values], module=__name__, qualname=name)


Backend = _choice("Backend", "auto", "gloo", "nccl", "mpi")
Precision = _choice("Precision", "fp32", "bf16", "fp16", "auto")
HALF_PRECISIONS = ("bf16", "fp16")  # 2-byte compute: activations, casts, collectives
# train.float8's scaling (torchao's Float8LinearRecipeName): one scale a tensor, one a row, or
# a row's with the weight gradient's matmul in high precision (rank/parallel/float8.py).
Float8Recipe = _choice("Float8Recipe", "tensorwise", "rowwise", "rowwise_with_gw_hp")
# meshrun-verify's reference: one device with the layout's settings, without train.float8, or
# with train.loss=full
VerifyReference = _choice("VerifyReference", "same", "high_precision", "full_loss")
# The styles a TP plan maps module names to (rank/parallel/tensor.py says what each does).
TP_STYLES = ("colwise", "rowwise", "embedding", "head", "sequence_parallel", "gather_input")
# train.loss: how the loss meets the vocabulary (models/loss.py decides auto, per layout).
LossMethod = _choice("LossMethod", "auto", "chunked", "vocab_parallel", "full")
# train.loss_kernel: what computes a chunked loss (Liger's fused kernel on CUDA, or torch).
LossKernel = _choice("LossKernel", "auto", "liger", "torch")
Schedule = _choice("Schedule", "gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb")
Checkpointing = _choice("Checkpointing", "none", "full", "selective", "op")
# Selective activation checkpointing (torch's SAC): some ops' outputs kept, the rest recomputed
SAC_POLICIES = ("selective", "op")
# How a context-parallel group shares attention (rank/parallel/context_attention.py).
CpMethod = _choice("CpMethod", "ring", "allgather", "alltoall")
DataParallel = _choice("DataParallel", "auto", "dataparallel")
# Where FSDP2's sharded state or the blocks' saved activations live (parallel.fsdp.offload,
# parallel.activation_offload): the device, or the host's memory.
Offload = _choice("Offload", "none", "cpu")
# AdamW's moments (train.optimizer_states): fp32, bf16 with stochastic rounding, torchao's 8-bit.
OptimizerStates = _choice("OptimizerStates", "fp32", "bf16", "8bit")
# Replica-level fault tolerance (driver/launch/replicas.py, rank/train/replicas.py).
FaultTolerance = _choice("FaultTolerance", "none", "torchft")
# A mixture-of-experts router's scores, and how it keeps the experts' loads even (models/moe.py).
RouterScore = _choice("RouterScore", "softmax", "sigmoid")
LoadBalance = _choice("LoadBalance", "aux_loss", "bias", "none")
Scaling = _choice("Scaling", "weak", "strong")
BaselineMode = _choice("BaselineMode", "fresh", "stored", "off")
LoggerMode = _choice("LoggerMode", "auto", "online", "offline", "disabled")
FailMode = _choice("FailMode", "raise", "hang", "kill")
CORRUPT_MODES = ("nan", "spike")  # debug.corrupt_mode: a str field (Hydra reads nan a float)
DeviceType = _choice("DeviceType", "cpu", "cuda")
StartMethod = _choice("StartMethod", "spawn", "fork", "forkserver")
LrDecay = _choice("LrDecay", "constant", "linear", "cosine")
DataName = _choice("DataName", "synthetic", "text", "hf")
DataFormat = _choice("DataFormat", "json", "parquet", "text", "disk")
ExportFormat = _choice("ExportFormat", "none", "hf", "torch")
