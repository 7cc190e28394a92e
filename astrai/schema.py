"""The column contract between the preprocess stage and the stages that read its output.

Train, eval and inspect read shards through these names; a second copy of any of them elsewhere is
a bug waiting for the first to change. (The structure refactor moves every existing use here.)
"""

IGNORE_INDEX = -100  # label of a token that is not trained (Hugging Face convention, labels not shifted)

INPUT_IDS = "input_ids"
LABELS = "labels"
POSITION_IDS = "position_ids"
SEQ_LENS = "seq_lens"
TOKEN_COLUMNS = (INPUT_IDS, LABELS, POSITION_IDS, SEQ_LENS)
