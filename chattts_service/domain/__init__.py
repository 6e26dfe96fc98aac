"""What speech is made of, below every layer that makes it: texts (control tokens, sentences,
normalisation), voices (embeddings, seeds, blends, recordings, and where they are kept) and
playback (how far a stream falls behind its listener).

Imports nothing above ``runtime`` and ``config``: the inference layer builds prompts from these
types, the services and the API take requests in them.
"""
