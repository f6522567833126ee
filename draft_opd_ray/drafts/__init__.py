"""The draft kinds, one folder each (`eagle3/`, `standalone/`, `dflash/`: model, student, SFT recipe, drafter),
the bases they share (`kind.py`, `student.py`, `recipe.py`, `drafter.py`) and their table (`registry.py`)."""
