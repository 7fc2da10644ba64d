"""xtrain's Hydra launcher plugins (``hydra/launcher=tpu_vm|tpu_pod``); see launch/README.md."""
