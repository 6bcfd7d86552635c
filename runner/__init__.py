"""Serving: the four jit-compiled functions, batch slots, pad buckets, sampling, tokenization and
the ``run()`` generator. No model math (that is ``model/``)."""
