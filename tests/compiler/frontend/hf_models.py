"""Tiny Hugging Face decoders built from config objects with random weights (nothing is
downloaded): code nobody on this project wrote, as a user would bring it.

Every family with grouped-query attention gets fewer key/value heads than query heads; every
dropout is 0 so the sliced run and plain autograd see the same model.
"""

from __future__ import annotations

import os

import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the network

VOCAB = 128
_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
_LAYERS = dict(num_hidden_layers=2, max_position_embeddings=64)

CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2),
    "qwen2": dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2),
    "mistral": dict(model_type="mistral", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                    num_key_value_heads=2, sliding_window=None),
    "gemma": dict(model_type="gemma", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8),
    "phi3": dict(model_type="phi3", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, sliding_window=None, resid_pdrop=0.0, embd_pdrop=0.0,
                 attention_dropout=0.0),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                     hidden_dropout=0.0, attention_dropout=0.0),
    "opt": dict(model_type="opt", hidden_size=32, ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32,
                dropout=0.0, attention_dropout=0.0),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_head=4, n_layer=2, n_positions=64, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0),
}
FAMILIES = tuple(CONFIGS)

# beyond the families above: other attention code paths of the same library
MORE_CONFIGS = {
    # global and local (window 4) layers; local attention written as where(mask, s, tensor(min))
    "gpt_neo": dict(model_type="gpt_neo", hidden_size=32, num_layers=2, num_heads=4, window_size=4,
                    attention_types=[[["global", "local"], 1]], max_position_embeddings=64,
                    embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0),
    # eager scores scaled in place (scores /= sqrt(d))
    "falcon": dict(model_type="falcon", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   hidden_dropout=0.0, attention_dropout=0.0),
    # q/k norms per head
    "qwen3": dict(model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    # a sliding window in every layer, biases
    "starcoder2": dict(model_type="starcoder2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, sliding_window=4, residual_dropout=0.0,
                       embedding_dropout=0.0, attention_dropout=0.0),
    # ALiBi: slope * key position added through baddbmm on (B * H, q, k) scores (eager only)
    "bloom": dict(model_type="bloom", hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
                  attention_dropout=0.0),
    # ALiBi: slope * (key - (max_seq_len - 1)) sliced from a max_seq_len table (eager only)
    "mpt": dict(model_type="mpt", d_model=32, n_layers=2, n_heads=4, max_seq_len=64, expansion_ratio=2,
                attn_config=dict(attn_pdrop=0), resid_pdrop=0, emb_pdrop=0),
    # Falcon's ALiBi variant: the bias goes to SDPA in a float mask
    "falcon_alibi": dict(model_type="falcon", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         hidden_dropout=0.0, attention_dropout=0.0, alibi=True),
    # short causal convolutions (Conv1d(padding=k - 1)[..., :T]) beside attention layers
    "lfm2": dict(model_type="lfm2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
                 conv_L_cache=3),
    # attention logit soft-capping (c * tanh(scores / c)), windowed and global layers
    "gemma2": dict(model_type="gemma2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                   max_position_embeddings=64),
    # multi-head latent attention: keys built in `new_empty` and filled by `copy_` into slices;
    # both layers dense (first_k_dense_replace), no experts
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                        first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        n_group=1, topk_group=1),
    # the eager scores clamped to the dtype's minimum after the mask (max(s + mask, finfo.min))
    "xglm": dict(model_type="xglm", d_model=32, ffn_dim=64, num_layers=2, attention_heads=4, dropout=0.0,
                 attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=64),
    # attention sinks: a learned logit per head joined to the scores as one more key column;
    # windowed and global layers; mixture-of-experts MLPs
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    # chunked local attention (chunks of 4 tokens) in layer 0, global attention in layer 1; the
    # experts off (moe_layers=[]): dense MLPs
    "llama4_text": dict(model_type="llama4_text", hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        attention_chunk_size=4, moe_layers=[], num_local_experts=2, no_rope_layers=[1, 0],
                        use_qk_norm=False),
    # state-space models: Mamba's selective scan (Hugging Face's reference path is a loop over the
    # tokens; the front end puts its own op in its place) and the hybrids built on it
    "mamba": dict(model_type="mamba", hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
                  use_mambapy=False),
    "falcon_mamba": dict(model_type="falcon_mamba", hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
                         conv_kernel=4, use_mambapy=False),
    # Mamba's layers and attention, experts in layer 1
    "jamba": dict(model_type="jamba", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=2, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
                  mamba_dt_rank=4),
    # two Mamba heads per layer, a shared attention block in the hybrid layers (at least two of them)
    "zamba": dict(model_type="zamba", hidden_size=32, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=4, attention_hidden_size=64, attention_head_dim=16, mamba_d_state=4,
                  mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, n_mamba_heads=2,
                  layer_types=["linear_attention", "hybrid", "linear_attention", "hybrid"]),
    # Mamba-2's chunked scan (state-space duality), chunks of 4 tokens, and the hybrids built on it
    "mamba2": dict(model_type="mamba2", hidden_size=32, state_size=8, expand=2, num_heads=8, head_dim=8, n_groups=2,
                   chunk_size=4, conv_kernel=4),
    "bamba": dict(model_type="bamba", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
                  mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4),
    "zamba2": dict(model_type="zamba2", hidden_size=32, num_attention_heads=4, num_key_value_heads=4, mamba_d_state=8,
                   mamba_d_conv=4, mamba_expand=2, mamba_headdim=8, mamba_ngroups=2, chunk_size=4,
                   layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1], attention_head_dim=8),
    "granitemoehybrid": dict(model_type="granitemoehybrid", hidden_size=32, intermediate_size=32,
                             shared_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                             num_local_experts=2, num_experts_per_tok=1, layer_types=["mamba", "attention"],
                             mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                             mamba_expand=2, mamba_chunk_size=4),
    # Mamba-2, attention and MLP layers
    "nemotron_h": dict(model_type="nemotron_h", hidden_size=32, num_hidden_layers=3, intermediate_size=64, hybrid_override_pattern="M*-",
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=8,
                       mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, expand=2, chunk_size=4),
    # attention and Mamba-2 side by side in every layer
    "falcon_h1": dict(model_type="falcon_h1", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
                      mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4, mamba_d_ssm=64),
    # RWKV's WKV recurrence (a loop over the tokens on the CPU; the front end's op in its place)
    "rwkv": dict(model_type="rwkv", hidden_size=32, attention_hidden_size=32, intermediate_size=64,
                 context_length=64),
    # Griffin: two RG-LRU recurrent blocks (a method looping over the tokens, replaced likewise)
    # and a local attention block, logits soft-capped
    "recurrent_gemma": dict(model_type="recurrent_gemma", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=8, lru_width=32,
                            attention_window_size=8, conv1d_width=4, block_types=["recurrent", "recurrent", "attention"],
                            logits_soft_cap=30.0),
    # mixture-of-experts: tokens grouped by expert (sort), run through grouped matmuls, put back
    "mixtral": dict(model_type="mixtral", hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=None),
    # ... with a shared expert beside the routed ones, gated per token
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    "olmoe": dict(model_type="olmoe", hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                      num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
    "granitemoe": dict(model_type="granitemoe", hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "dots1": dict(model_type="dots1", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=4,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1),
}
CONFIGS.update(MORE_CONFIGS)
# DeepSeek-V3 with its second layer a mixture of experts (group-limited routing, a shared expert)
CONFIGS["deepseek_v3_moe"] = dict(CONFIGS["deepseek_v3"], first_k_dense_replace=1)
IMPLS = ("sdpa", "eager")


def config_dict(family: str, **overrides) -> dict:
    """The settings of a tiny `family` model, as a config.json would hold them."""
    out = dict(CONFIGS[family], vocab_size=VOCAB, **_IDS)
    if family not in ("gpt2", "gpt_neo", "bloom", "mpt"):
        out = {**_LAYERS, **out}  # (a family's own layer count wins: Zamba's, NemotronH's)
    out.update(overrides)
    return out


def hf_model(family: str, impl: str, seed: int = 0, **overrides):
    """A tiny `family` causal LM with `attn_implementation=impl`, forward(ids) -> logits (the
    same adapter `tpc compile config.json` uses)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tpc.compiler.frontend.hf import returning_logits

    settings = config_dict(family, **overrides)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(seed)
    return returning_logits(AutoModelForCausalLM.from_config(config, attn_implementation=impl))


def assert_grads_match(got: dict, ref: dict, rel: float = 1e-5) -> None:
    """Every parameter's gradient within `rel` of plain autograd's, by the one gradient-error
    measure (`tpc.executors.oracle.gradient_error`: max |a - b| over the parameter's largest
    entry, a parameter whose true gradient is zero, such as OPT's key bias, held to a floor of a
    thousandth of the model's largest entry)."""
    from tpc.executors.oracle import gradient_error

    assert set(got) == set(ref), set(got) ^ set(ref)
    worst, name = gradient_error(got, ref)
    assert worst <= rel, f"{name}: relative gradient error {worst:.3g} > {rel}"
