"""The science of the FFN workflow, in plain Python (no Parsl): see the README for the stages."""

import os

# Set before TensorFlow is first imported (every TF user imports `pipeline` first). TensorFlow
# enables oneDNN by default only on CPUs with AVX-512/AMX; on AVX2-only CPUs (the AMD EPYC this
# project is developed on) turning it on makes Conv3D training about twice as fast.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # hide INFO start-up notices, keep warnings

import warnings

# cloud-volume's Google libraries warn at import time that Python 3.11 reaches end of life in 2027.
warnings.filterwarnings("ignore", category=FutureWarning, module="google.api_core")
