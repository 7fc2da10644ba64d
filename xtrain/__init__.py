from xtrain.import_hooks import TorchmetricsWithoutExtras

TorchmetricsWithoutExtras.install()
