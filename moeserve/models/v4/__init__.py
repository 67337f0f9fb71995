"""DeepSeek-V4's layers (torch reference): hyper-connections (`hyper`), the compressors and the
lightning indexer (`compressor`), and the attention over a sliding window plus compressed
entries with a grouped output projection (`attention`). Its MoE is the common `MoEBlock`
(sqrtsoftplus or hash routing, clamped SwiGLU)."""
