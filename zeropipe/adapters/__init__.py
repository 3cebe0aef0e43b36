"""Adapters: real models cut into pipeline stages (``split``) and their losses (``causal_lm_loss``).

``split.py`` dispatches on the model (``nn.Sequential``, Hugging Face causal
LMs via ``hf.py``, their mixtures of experts via ``hf_moe.py``, a clear error
otherwise); ``loss.py`` holds the causal-LM loss that a pipeline normalises
over the batch's counted tokens (plus a mixture's router loss, per microbatch).
"""
