"""Model loading (HF dirs, GGUF, tiny test models), scalar-head models and FSDP2 × TP parallelism."""

from torchrlhf.models.heads import (
    ValueModel,
    build_meta_value_model,
    init_value_head,
    load_value_model,
    load_value_weights,
    score_at_last_token,
)
from torchrlhf.models.loading import (
    build_tiny_causal_lm,
    load_causal_lm,
    load_tokenizer,
    save_tiny_model,
    smollm2_gguf_path,
    smollm2_model_dir,
    smollm2_tokenizer,
    strip_quantizer,
    tiny_llama_config,
)
from torchrlhf.models.parallelize import (
    TP_SUPPORTED_MODEL_TYPES,
    apply_tp,
    check_tp_compatible,
    enable_activation_checkpointing,
    find_transformer_blocks,
    parallelize,
)
from torchrlhf.models.sharded import (
    SafetensorsReader,
    build_meta_causal_lm,
    load_causal_lm_sharded,
    load_weights,
    safetensors_files,
)

__all__ = [
    "SafetensorsReader",
    "TP_SUPPORTED_MODEL_TYPES",
    "ValueModel",
    "apply_tp",
    "build_meta_causal_lm",
    "build_meta_value_model",
    "build_tiny_causal_lm",
    "check_tp_compatible",
    "enable_activation_checkpointing",
    "find_transformer_blocks",
    "init_value_head",
    "load_causal_lm",
    "load_causal_lm_sharded",
    "load_tokenizer",
    "load_value_model",
    "load_value_weights",
    "load_weights",
    "parallelize",
    "safetensors_files",
    "save_tiny_model",
    "score_at_last_token",
    "smollm2_gguf_path",
    "smollm2_model_dir",
    "smollm2_tokenizer",
    "strip_quantizer",
    "tiny_llama_config",
]
