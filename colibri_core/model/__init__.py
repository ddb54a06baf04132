"""What a model is before it runs: the family interface, typed config parsing, the
validated blueprint of a model directory, and its tokenizer."""
