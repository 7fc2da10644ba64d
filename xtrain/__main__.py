from xtrain.cli import main

main()
