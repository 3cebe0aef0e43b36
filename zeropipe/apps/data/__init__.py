"""The text ``zeropipe train`` reads: the generated corpus, ``--data``'s token files, the tokenizer."""
