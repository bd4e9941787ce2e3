"""The shipped demo model pair: its corpus, tokenizer and target pre-training.

Nothing may be downloaded at run time, so the project trains its own small models on a corpus every machine
already has: the Python standard library's source code. This subpackage turns that source into a reproducible,
manifest-backed token corpus (:mod:`.corpus`), trains the byte-level BPE tokenizer whose last id is the
drafter's mask token (:mod:`.tokenizer`), and pre-trains the small Qwen3 target with a wall-clock-bounded
PyTorch loop (:mod:`.pretrain`). The same corpus windows feed drafter training later. Imports stay light here:
each module pulls in torch / transformers / tokenizers only where it needs them, so the ``dspark`` CLI starts
fast.
"""
