"""The Hugging Face adapter: a ``transformers`` model trained on densebatch's batches, documents kept apart.

``adapter.py`` (``HFCausalLM``), ``loading.py`` (the transformers model built from a local directory),
``attention.py`` (densebatch's attention registered with transformers),
``masks.py`` (the 4-D document mask under sdpa / eager), ``checks.py`` (what is checked before a model
is built), ``falcon.py`` (Falcon's attention class under older transformers), ``weights.py`` (the
weights read from safetensors files, rank by rank), ``lora.py`` (LoRA adapters through peft). Import
from the modules themselves.
"""
