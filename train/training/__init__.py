"""One run: assemble it (build), train it (trainer), and the pieces the loop uses."""
