"""`hintserve doctor`: what this machine and a model directory mean for serving, and the flags to start with."""
