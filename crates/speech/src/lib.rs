//! Speech to text as a task, whichever engine runs the model.
//!
//! Audio in any common container is decoded, counted and resampled to 16 kHz mono
//! (`audio`), turned into Whisper's log-mel windows (`mel`), and transcribed by a
//! decoding loop that advances in short slices — an encoder run for a new window, one
//! decoder step for a batch of sequences — so the server's scheduler can batch steps
//! across requests and interleave other models' work between them (`whisper`). An
//! engine (ONNX Runtime in `snooze-backend-ort`) supplies only the encoder and decoder
//! passes.

pub mod audio;
pub mod format;
pub mod languages;
pub mod mel;
pub mod openai;
pub mod whisper;
