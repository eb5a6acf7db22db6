"""The model side of the packed path: unwrapping, compiling the decoder blocks, the packed LM head."""

from __future__ import annotations

import torch


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks of a (PEFT-wrapped) causal LM."""
    return list(unwrap(model).model.layers)


def unwrap(model):
    """The transformers model under DDP and PEFT wrappers."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def compile_layers(model) -> int:
    """torch.compile each decoder block: one graph, reused by every block, with the sequence length
    dynamic from the first call (dynamic=True), so a new packed length never recompiles. Returns the count."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 512)
    import torch.fx.experimental._config as fx_config

    # Sizes that happen to be equal in the first step (two groups' widths, say) must not become one
    # symbol: that would recompile the block when they differ.
    fx_config.use_duck_shape = False
    # Every block then gets an input that requires grad, the first one too (its input, the frozen
    # embedding's output, would not): one graph for all 36 blocks instead of a second compile for block 0.
    unwrap(model).enable_input_require_grads()
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)



def add_packed_lm_head(model) -> None:
    """`model(..., packed_head=True, target_index=I, target_ids=Y)` returns (log_probs, is_top1) of the
    positions I (flattened row) against Y, through TRL's chunked LM-head kernel (vocabulary tiles, no
    [tokens, vocab] logits). The argmax test is folded into the same tiles, so the token accuracy
    costs no pass over the vocabulary; the positions come from the host, so no GPU sync."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    original_forward = model.forward

    def packed_forward(self, *args, packed_head: bool = False, target_index=None, target_ids=None, **kwargs):
        if not packed_head:
            return original_forward(*args, **kwargs)
        for key in ("labels", "output_attentions", "output_hidden_states", "return_dict"):
            kwargs.pop(key, None)
        kwargs["use_cache"] = False
        hidden = getattr(self, self.base_model_prefix)(*args, **kwargs).last_hidden_state
        lm_head = self.get_output_embeddings()
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, target_index)
        log_probs, _, _, _, is_top1 = ChunkedLogProbFunction.apply(
            hidden, lm_head.weight, lm_head.bias, target_ids, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
            ("is_top1",))
        return log_probs, is_top1

    import types
    model.forward = types.MethodType(packed_forward, model)

