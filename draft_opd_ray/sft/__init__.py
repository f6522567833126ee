"""SFT recipes: target trajectories (data), target features (features), EAGLE-3 TTT trainer (trainer), run script."""
