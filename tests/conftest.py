import warnings

warnings.filterwarnings("ignore", module="megatron")
warnings.filterwarnings("ignore", message=".*Apex.*")
