"""`python -m training.train`: train a model (training.cli has the flags, training.loop the loop)."""
from training.cli import main

if __name__ == "__main__":
    main()
