"""sahajBERT with dedloc-jax: the local demo, the trainer/coordinator/aux roles, fine-tuning.

Run ``python -m examples.sahajbert --help``; see :mod:`examples.sahajbert.__main__`.
"""
