# Makes the top-level packages importable when pytest runs from a clean clone without an install.
