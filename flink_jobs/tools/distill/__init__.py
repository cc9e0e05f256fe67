"""Distillation: a LoRA adapter of the serving model trained on what shoppers did next.

``shopper-intents distill data`` replays recorded events through the job's own session
and trigger code (``core.timeline``) and pairs every prompt that would fire, rendered with
the compact template, with a target intent taken from hindsight (``hindsight``);
``distill train`` trains the adapter on the train split with peft, in the vLLM venv
(``train_worker``), and writes it with its model card (``card``).

Modules:

- ``splits``: train, validation and test by a stable hash of the shopper id;
- ``hindsight``: the target intent of one trigger point, from the events after it;
- ``dataset``: sources (the sample generator, The Complete Journey, a recording), the
  trigger points and the JSONL examples;
- ``train_worker``: the training loop (torch, transformers, peft), run as its own process;
- ``card``: the model card and its loss curve;
- ``commands``: the ``distill`` subcommands.
"""
