"""The loss of a micro-batch, as train.loss says (models/loss.py decides `auto`).

`full`: the model returns the logits, the cross-entropy upcasts all of them to fp32.
`vocab_parallel` (TP): the head's output stays sharded over the vocabulary (parallel/
tensor.py) and torch's `loss_parallel` computes the cross-entropy on the shards, forward and
backward inside its context (`loss_context`). `chunked`: the loss runs inside the head
module's own forward, over chunks of tokens, each chunk's gradients taken in forward
(ChunkedCrossEntropy), so one chunk's logits exist at a time; on CUDA, where
train.loss_kernel resolves to `liger`, Liger's fused linear cross-entropy does the same in
Triton over the head's weight (`liger_cross_entropy`). Inside the head's forward, because
that is where every wrapper expects the head's weights used: FSDP2's unshard and its
backward hooks, DDP's, a pipeline stage's; the model then returns the
micro-batch's mean loss (0-d) in place of its logits. The targets reach the head as the
`targets` keyword of the model part's call, which a pre-hook takes off before the part's
own forward (a pipeline schedule passes keywords to every stage, split per micro-batch)."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from meshrun.models.loss import chunk_tokens
from meshrun.models.vocab import unpad_logits

IGNORE_INDEX = -100  # F.cross_entropy's: such targets count in neither sum nor mean


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of [batch, seq, vocab] logits, in fp32; of vocabulary-sharded
    logits (a DTensor, inside `loss_context`), the replicated loss as this rank's tensor
    (its backward hands the shards' gradients back as a replicated DTensor)."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return loss.to_local() if isinstance(loss, DTensor) else loss


def micro_batch_loss(
    module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, method: str
) -> torch.Tensor:
    """The mean loss of one micro-batch through `module` (a model part with the head)."""
    if method == "chunked":
        return module(inputs, targets=targets)
    return cross_entropy(module(inputs), targets)


def stage_loss(output: torch.Tensor, targets: torch.Tensor, method: str) -> torch.Tensor:
    """A pipeline's last stage's loss from its output: the loss itself under `chunked`."""
    return output if method == "chunked" else cross_entropy(output, targets)


def loss_context(method: str) -> contextlib.AbstractContextManager:
    """What the forward and backward of a `method` loss run inside."""
    return loss_parallel() if method == "vocab_parallel" else contextlib.nullcontext()


class ChunkedLoss:
    """Mixed into the head's own class (its parameters, hooks and names unchanged): given
    targets (`loss_targets`, set for one call by the part's pre-hook) its forward returns
    the mean cross-entropy over chunks of tokens instead of the logits."""

    loss_targets: torch.Tensor | None = None
    loss_vocab: int = 0
    loss_kernel: str = "torch"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.loss_targets is None:
            return super().forward(hidden)
        # Liger takes the head's gradients only with the input's (liger_kernel/ops/
        # fused_linear_cross_entropy.py, 0.8.5: grad_weight None unless input_requires_grad):
        # a frozen trunk's loss runs on torch's chunks
        if self.loss_kernel == "liger" and (hidden.requires_grad or not torch.is_grad_enabled()):
            return liger_cross_entropy(self, hidden, self.loss_targets, self.loss_vocab)
        params = [p for p in self.parameters() if p.requires_grad]
        return chunked_cross_entropy(
            super().forward, params, hidden, self.loss_targets, self.loss_vocab
        )


def chunked_cross_entropy(
    head, params: list[torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor, vocab: int
) -> torch.Tensor:
    """The mean of the tokens' cross-entropies, `head` (hidden -> logits, its parameters
    `params`) run over chunk_tokens(vocab) tokens at a time."""
    if torch.is_grad_enabled():
        return ChunkedCrossEntropy.apply(head, vocab, hidden, targets, *params)
    total, count, _ = _over_chunks(head, vocab, hidden, targets, [], grads=False)
    return total / count


def liger_cross_entropy(
    head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, vocab: int
) -> torch.Tensor:
    """The mean cross-entropy by Liger's fused linear cross-entropy (Triton, CUDA): the
    head's weight and bias taken in place of its forward, a padded vocabulary's extra rows
    cut (as unpad_logits cuts the logits). Liger, like ChunkedCrossEntropy, takes each
    chunk's gradients in forward, its chunk's logits about tokens x hidden of the input's
    dtype (models/loss.liger_chunk_tokens); it reads the count of targets to the host once a
    call (its forward's `target_mask.sum().item()`), a sync a micro-batch that torch's
    chunks do not make."""
    from liger_kernel.transformers.functional import (  # noqa: PLC0415 (meshrun[liger])
        liger_fused_linear_cross_entropy,
    )

    bias = None if head.bias is None else head.bias[:vocab]
    return liger_fused_linear_cross_entropy(
        hidden.flatten(0, -2),
        head.weight[:vocab],
        targets.flatten(),
        bias,
        ignore_index=IGNORE_INDEX,
    )


class ChunkedCrossEntropy(torch.autograd.Function):
    """The loss and its gradients, chunk by chunk in forward (as Liger's fused linear
    cross-entropy): each chunk's logits live only while its share of the gradients is taken,
    and backward scales what forward kept, a hidden-sized input gradient and the head's
    parameter gradients (which backward would hold from its first step anyway). Recomputing
    each chunk in backward instead (torch.utils.checkpoint) ran the head's matmul and
    softmax twice (0.69x full's tokens/s in one run of tiny with a 65,536-token vocabulary;
    this way 1.03x, benchmarks/loss_memory.py)."""

    @staticmethod
    def forward(ctx, head, vocab: int, hidden, targets, *params):
        total, count, grads = _over_chunks(head, vocab, hidden, targets, list(params), grads=True)
        ctx.save_for_backward(count, *grads)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        count, grad_hidden, *grad_params = ctx.saved_tensors
        scale = grad_loss / count
        return None, None, grad_hidden * scale, None, *(g * scale for g in grad_params)


def _over_chunks(head, vocab: int, hidden, targets, params: list[torch.Tensor], grads: bool):
    """(the summed loss, the targets counted, where `grads`, the gradients of that sum for
    `hidden` and `params`)."""
    flat, flat_targets = hidden.flatten(0, -2), targets.flatten()
    total = torch.zeros((), device=hidden.device)
    grad_hidden = torch.empty_like(flat) if grads else None
    grad_params = [torch.zeros_like(p) for p in params]
    size = chunk_tokens(vocab)
    for start in range(0, flat.shape[0], size):
        chunk = flat[start : start + size].detach().requires_grad_(grads)
        with torch.enable_grad() if grads else torch.no_grad():  # the logits not kept:
            loss = _summed_loss(head(chunk), flat_targets[start : start + size], vocab)
        if grads:
            got = torch.autograd.grad(loss, [chunk, *params])
            grad_hidden[start : start + size] = got[0]
            if grad_params:
                torch._foreach_add_(grad_params, list(got[1:]))
        total += loss.detach()
    count = (flat_targets != IGNORE_INDEX).sum()
    return total, count, [grad_hidden.view_as(hidden), *grad_params] if grads else []


def _summed_loss(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """A chunk's summed loss; its logits freed once their log-softmax is taken."""
    return F.cross_entropy(unpad_logits(logits, vocab).float(), targets, reduction="sum")


@functools.cache
def _chunked_class(cls: type[nn.Module]) -> type[nn.Module]:
    return type(f"Chunked{cls.__name__}", (ChunkedLoss, cls), {})


def apply_chunked_loss(part: nn.Module, kernel: str = "torch") -> None:
    """`part` (a model or a pipeline stage's cut of it) takes `targets=`; where it holds the
    head, the head computes the loss with them, by `kernel` (train.loss_kernel: liger or
    torch)."""
    head = part.output
    if head is not None:
        if kernel == "liger" and type(head) is not nn.Linear:
            raise TypeError(
                f"train.loss_kernel=liger takes a plain nn.Linear head, and this model's is "
                f"a {type(head).__name__}: set train.loss_kernel=torch"
            )
        head.__class__ = _chunked_class(type(head))
        head.loss_vocab = part.vocab_size
        head.loss_kernel = kernel
    part.register_forward_pre_hook(functools.partial(_take_targets, head), with_kwargs=True)
    if head is not None:
        part.register_forward_hook(functools.partial(_drop_targets, head), always_call=True)


def _take_targets(head: nn.Module | None, _: nn.Module, args: tuple, kwargs: dict):
    targets = kwargs.pop("targets", None)
    if head is not None:
        head.loss_targets = targets
    return args, kwargs


def _drop_targets(head: nn.Module, *_) -> None:
    head.loss_targets = None
