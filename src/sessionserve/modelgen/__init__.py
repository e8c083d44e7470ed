"""Making models, apart from running them: the embedded default (`make_model`: a real architecture with
random weights and a tokenizer trained on local text), its training and distillation. The runtime
(`sessionserve.model`) never imports this package; it loads what these write as any Hugging Face folder."""
