"""Preparation: records → cleaned, templated, tokenised documents in an on-disk store, cached by content.

Reading (``sources``), cleaning (``clean``), prompt templates (``templates``, ``chat_template``),
tokenizers (``tokenizers``, ``tokenizer_files``, ``vocab``), documents with their loss mask
(``documents``), the streamed build (``stream``), its cache key (``cache``), the embedded default
dataset (``default_dataset``), a mixture's sources (``source_configs``) and the whole stage
(``pipeline.prepare``), writing the store of ``data/store/``; it imports nothing of the planning
stage (a guard test holds it). Import submodules directly; this package re-exports nothing, so that
importing one stage never loads the others.
"""
