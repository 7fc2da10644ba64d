"""xtrain's Hydra plugins: launchers (``hydra/launcher=tpu_vm|tpu_pod``, see launch/README.md)
and the sweeper (``hydra/sweeper=xtrain``, conf/train.yaml's default)."""
