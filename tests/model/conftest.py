import sys
from pathlib import Path

# tests/model/families.py (the tiny transformers models of every family) is a test tool, not package code.
sys.path.insert(0, str(Path(__file__).resolve().parent))
