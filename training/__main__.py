"""`python -m training` = `python -m training.train`."""
from training.cli import main

main()
