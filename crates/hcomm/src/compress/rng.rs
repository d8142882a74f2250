//! A small deterministic random number generator (SplitMix64) and the random-k index choice
//! built on it. Deterministic across processes, platforms and runs: every rank that starts
//! from the same seed draws the same numbers.

/// SplitMix64 (Steele, Lea, Flood 2014): 64 bits of state, passes BigCrush, one multiply
/// chain per number. Not for secrets.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform number in `[0, 1)` with 24 random bits (every value exactly representable
    /// in f32).
    #[inline]
    pub fn next_unit_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// A uniform number in `0..m` (`m > 0`), without bias (Lemire's multiply-and-reject).
    #[inline]
    pub fn below(&mut self, m: u64) -> u64 {
        debug_assert!(m > 0);
        let threshold = m.wrapping_neg() % m;
        loop {
            let r = self.next_u64() as u128 * m as u128;
            if (r as u64) >= threshold {
                return (r >> 64) as u64;
            }
        }
    }
}

/// Mix several words into one seed (each word goes through a SplitMix64 step, so seeds that
/// differ in one bit give unrelated streams).
pub fn mix_seed(words: &[u64]) -> u64 {
    words.iter().fold(0x243f_6a88_85a3_08d3u64, |h, &w| {
        SplitMix64::new(h ^ w.rotate_left(17)).next_u64()
    })
}

/// `k` distinct indices of `0..n`, uniformly among all k-subsets, in ascending order; the
/// same for every caller with the same `(seed, n, k)`. `k` larger than `n` means all of them.
///
/// Robert Floyd's sampling: one random draw per chosen index, membership in a bitset
/// (`n / 8` bytes), then one pass over the bitset for the ascending order.
pub fn random_k_indices(seed: u64, n: usize, k: usize) -> Vec<u32> {
    let k = k.min(n);
    if k == n {
        return (0..n as u64).map(|i| i as u32).collect();
    }
    let mut rng = SplitMix64::new(seed);
    let mut bits = vec![0u64; n.div_ceil(64)];
    let set = |i: usize, bits: &mut Vec<u64>| -> bool {
        let (w, b) = (i / 64, 1u64 << (i % 64));
        let was = bits[w] & b != 0;
        bits[w] |= b;
        was
    };
    for j in n - k..n {
        let t = rng.below(j as u64 + 1) as usize;
        if set(t, &mut bits) {
            set(j, &mut bits);
        }
    }
    let mut out = Vec::with_capacity(k);
    for (w, &word) in bits.iter().enumerate() {
        let mut word = word;
        while word != 0 {
            let b = word.trailing_zeros() as usize;
            out.push((w * 64 + b) as u32);
            word &= word - 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_k_is_k_distinct_sorted_and_reproducible() {
        for (n, k) in [(0, 0), (1, 1), (10, 3), (1000, 10), (1000, 999), (100, 500)] {
            let a = random_k_indices(42, n, k);
            assert_eq!(a.len(), k.min(n));
            assert!(a.windows(2).all(|w| w[0] < w[1]), "sorted and distinct");
            assert!(a.iter().all(|&i| (i as usize) < n));
            assert_eq!(a, random_k_indices(42, n, k), "same seed, same indices");
        }
        assert_ne!(random_k_indices(1, 1000, 10), random_k_indices(2, 1000, 10));
    }

    #[test]
    fn random_k_covers_indices_evenly() {
        // 4000 draws of 10 out of 100: each index expected 400 times.
        let mut hits = [0u32; 100];
        for s in 0..4000 {
            for i in random_k_indices(mix_seed(&[7, s]), 100, 10) {
                hits[i as usize] += 1;
            }
        }
        assert!(hits.iter().all(|&h| (300..500).contains(&h)), "{hits:?}");
    }

    #[test]
    fn below_stays_in_range() {
        let mut r = SplitMix64::new(3);
        for m in [1u64, 2, 3, 7, 1 << 40, u64::MAX] {
            for _ in 0..100 {
                assert!(r.below(m) < m);
            }
        }
        let u = r.next_unit_f32();
        assert!((0.0..1.0).contains(&u));
    }
}
