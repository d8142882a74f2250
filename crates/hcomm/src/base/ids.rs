//! Identifiers and hashes that are not secrets: random ids for segments and communicators,
//! and the fold that condenses a list of numbers into one fingerprint word.

use std::sync::atomic::{AtomicU64, Ordering};

/// A random 64-bit number (time, pid and a counter through a hash; for ids, not for secrets).
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// FNV-1a-style fold of `values` into one word: stable across processes and builds of the
/// same version (std's hasher is randomised), so ranks can compare the results.
pub fn fold_hash(values: impl IntoIterator<Item = u64>) -> u64 {
    values.into_iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
        (h ^ v).wrapping_mul(0x0100_0000_01b3).rotate_left(17)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fold_hash_depends_on_order_and_values() {
        assert_eq!(fold_hash([1, 2, 3]), fold_hash([1, 2, 3]));
        assert_ne!(fold_hash([1, 2, 3]), fold_hash([3, 2, 1]));
        assert_ne!(fold_hash([1, 2]), fold_hash([1, 2, 0]));
    }

    #[test]
    fn random_ids_differ() {
        assert_ne!(random_u64(), random_u64());
    }
}
