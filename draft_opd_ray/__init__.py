"""draft_opd_ray: on-policy distillation (Draft-OPD) for speculative-decoding draft models on Ray, vLLM and DeepSpeed."""

__version__ = "0.1.0"
