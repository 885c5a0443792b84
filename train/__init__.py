"""zerotrain's training program: installed as zerotrain.train (setup.py), run as train/main.py."""
