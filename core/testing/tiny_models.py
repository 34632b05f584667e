"""Tiny random models of the Llama family, saved the way Hugging Face saves them
(the tests and `ember backends check` build them).

They exercise Ember's real loading code (config.json, safetensors, tokenizer
files) in seconds. The tokenizer is byte-level BPE with no merges: every UTF-8
byte is a token, so multi-byte characters span several tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB_SIZE = 320  # 256 bytes + specials, rounded up


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


ARCH = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
# Gemma: small heads, and a sliding window of 6 keys so that every test prompt slides
# (three layers: sliding, global, sliding); Gemma 2 keeps its soft-caps (50, 30)
GEMMA_DEFAULTS = {
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=6, num_hidden_layers=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "gemma3": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=6, num_hidden_layers=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                       "factor": 8.0}}),
}
# sparse MoE kinds: 4 experts, 2 per token; Qwen3-MoE's experts narrower than its
# dense layers (moe_intermediate_size), its second layer dense (mlp_only_layers)
MOE_DEFAULTS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[1], head_dim=32),
}


def make_tiny_model(kind: str, out_dir: Path, seed: int = 0, **overrides):
    """Save a tiny random `kind` model + tokenizer to out_dir; return the HF model (fp32)."""
    import transformers

    config_name, arch = ARCH[kind]
    tokenizer = byte_tokenizer()
    params = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=512,
        # Wider than the usual 0.02 so that random logits are well separated and
        # greedy decoding is not decided by float rounding.
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    if kind == "phi3":  # its config's default pad id (32000) lies outside this vocabulary
        params["pad_token_id"] = tokenizer.pad_token_id
    params.update(MOE_DEFAULTS.get(kind, {}))
    params.update(GEMMA_DEFAULTS.get(kind, {}))
    if kind.startswith("gemma"):
        params["pad_token_id"] = tokenizer.pad_token_id
    params.update(overrides)
    config = getattr(transformers, config_name)(**params)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model
