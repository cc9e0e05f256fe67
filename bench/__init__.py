"""Benchmarks of shopper-intents; each writes ``bench/results/<name>.json`` and ``.md``.

``python -m bench.routing``: routing policies compared on three vLLM workers (see
``docs/lab_notebook.md`` for the keys of its JSON).
"""
