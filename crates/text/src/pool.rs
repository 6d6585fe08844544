//! Token vectors to sentence vectors on the CPU, as sentence-transformers computes
//! them, for engines that return the encoder's token vectors (`last_hidden_state`).

use crate::Pooling;

/// Pools `hidden` (`[rows, len, dims]`, row-major, padding on the right) into one
/// vector per row; row `r` has `lengths[r]` real tokens.
pub fn pool(hidden: &[f32], lengths: &[usize], len: usize, dims: usize, pooling: Pooling) -> Vec<Vec<f32>> {
    lengths
        .iter()
        .enumerate()
        .map(|(r, &real)| {
            let row = &hidden[r * len * dims..(r + 1) * len * dims];
            let tokens = row.chunks_exact(dims).take(real.clamp(1, len));
            match pooling {
                Pooling::Cls => row[..dims].to_vec(),
                Pooling::Mean => {
                    let mut sum = vec![0f32; dims];
                    for t in tokens {
                        sum.iter_mut().zip(t).for_each(|(s, v)| *s += v);
                    }
                    // sentence-transformers clamps the count the same way.
                    let count = (real as f32).max(1e-9);
                    sum.iter_mut().for_each(|s| *s /= count);
                    sum
                }
                Pooling::Max => {
                    let mut max = vec![f32::NEG_INFINITY; dims];
                    for t in tokens {
                        max.iter_mut().zip(t).for_each(|(m, v)| *m = m.max(*v));
                    }
                    max
                }
            }
        })
        .collect()
}

/// `x / max(‖x‖, 1e-12)`, as `torch.nn.functional.normalize`.
pub fn l2_normalize(x: &mut [f32]) {
    let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
    x.iter_mut().for_each(|v| *v /= norm);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_ignores_padding() {
        // Row 0: two real tokens and one padding token with huge values that must not count.
        // Row 1: one real token.
        let hidden = [1.0, -2.0, 3.0, 4.0, 100.0, 100.0, 5.0, 6.0, 100.0, 100.0, 100.0, 100.0];
        let got = |p| pool(&hidden, &[2, 1], 3, 2, p);
        assert_eq!(got(Pooling::Mean), vec![vec![2.0, 1.0], vec![5.0, 6.0]]);
        assert_eq!(got(Pooling::Cls), vec![vec![1.0, -2.0], vec![5.0, 6.0]]);
        assert_eq!(got(Pooling::Max), vec![vec![3.0, 4.0], vec![5.0, 6.0]]);
    }

    #[test]
    fn normalize_gives_unit_rows_and_spares_zero_rows() {
        let mut x = [3.0f32, 4.0];
        l2_normalize(&mut x);
        assert_eq!(x, [0.6, 0.8]);
        let mut z = [0.0f32, 0.0];
        l2_normalize(&mut z);
        assert_eq!(z, [0.0, 0.0]);
    }
}
