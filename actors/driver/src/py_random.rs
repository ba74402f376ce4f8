//! Python's `random` module, as far as the cookbook's prepare_tasks.py uses it:
//! `random.seed(int)` and `random.shuffle(list)`, bit for bit.
//!
//! CPython's generator is MT19937 seeded by `init_by_array` with the 32-bit words of
//! `abs(seed)` (least significant first); `shuffle` walks the list from the end and
//! swaps each item with one drawn by `_randbelow`, which takes `getrandbits(k)` values
//! (k = the bit length of the bound) until one is below the bound.

const N: usize = 624;
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7fff_ffff;

/// The state of a Python `random.Random` instance.
pub struct PyRandom {
    mt: [u32; N],
    index: usize,
}

impl PyRandom {
    /// `random.seed(seed)` for an int seed (Python uses its absolute value).
    pub fn new(seed: i128) -> Self {
        let mut n = seed.unsigned_abs();
        let mut key = Vec::new();
        while n > 0 {
            key.push(n as u32);
            n >>= 32;
        }
        if key.is_empty() {
            key.push(0);
        }
        let mut rng = PyRandom {
            mt: [0; N],
            index: N,
        };
        rng.init_by_array(&key);
        rng
    }

    fn init_genrand(&mut self, seed: u32) {
        self.mt[0] = seed;
        for i in 1..N {
            let prev = self.mt[i - 1];
            self.mt[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        self.index = N;
    }

    fn init_by_array(&mut self, key: &[u32]) {
        self.init_genrand(19_650_218);
        let (mut i, mut j) = (1usize, 0usize);
        for _ in 0..N.max(key.len()) {
            let prev = self.mt[i - 1];
            self.mt[i] = (self.mt[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= N {
                self.mt[0] = self.mt[N - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..N - 1 {
            let prev = self.mt[i - 1];
            self.mt[i] = (self.mt[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_566_083_941))
                .wrapping_sub(i as u32);
            i += 1;
            if i >= N {
                self.mt[0] = self.mt[N - 1];
                i = 1;
            }
        }
        self.mt[0] = 0x8000_0000;
    }

    fn next_u32(&mut self) -> u32 {
        if self.index >= N {
            for k in 0..N {
                let y = (self.mt[k] & UPPER_MASK) | (self.mt[(k + 1) % N] & LOWER_MASK);
                let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
                self.mt[k] = self.mt[(k + M) % N] ^ (y >> 1) ^ mag;
            }
            self.index = 0;
        }
        let mut y = self.mt[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// `getrandbits(k)` for k ≤ 64: 32-bit words from the least significant up, the
    /// last one shifted down to the bits still wanted.
    pub fn getrandbits(&mut self, k: u32) -> u64 {
        assert!(k <= 64, "getrandbits beyond 64 bits is not needed here");
        if k == 0 {
            return 0;
        }
        if k <= 32 {
            return u64::from(self.next_u32() >> (32 - k));
        }
        let low = u64::from(self.next_u32());
        let high = u64::from(self.next_u32() >> (64 - k));
        low | (high << 32)
    }

    /// `_randbelow(n)` (n ≥ 1): rejection sampling over `getrandbits(n.bit_length())`.
    pub fn randbelow(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        let k = u64::BITS - n.leading_zeros();
        loop {
            let r = self.getrandbits(k);
            if r < n {
                return r;
            }
        }
    }

    /// `random.shuffle(items)`.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.randbelow(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn getrandbits_matches_cpython() {
        // python3 -c 'import random;random.seed(42);print([random.getrandbits(32) for _ in range(3)])'
        let mut rng = PyRandom::new(42);
        let got: Vec<u64> = (0..3).map(|_| rng.getrandbits(32)).collect();
        assert_eq!(got, vec![2_746_317_213, 478_163_327, 107_420_369]);
        // python3 -c 'import random;random.seed(7);print(random.getrandbits(40))'
        assert_eq!(PyRandom::new(7).getrandbits(40), 1_040_772_936_760);
    }

    #[test]
    fn shuffle_matches_cpython() {
        // python3 -c 'import random;random.seed(42);x=list(range(10));random.shuffle(x);print(x)'
        let mut rng = PyRandom::new(42);
        let mut x: Vec<u32> = (0..10).collect();
        rng.shuffle(&mut x);
        assert_eq!(x, vec![7, 3, 2, 8, 5, 6, 9, 4, 0, 1]);
        // Seeds wider than one 32-bit word, and negative seeds (abs).
        // python3 -c 'import random;random.seed(2**40+5);x=list(range(6));random.shuffle(x);print(x)'
        let mut rng = PyRandom::new((1i128 << 40) + 5);
        let mut wide: Vec<u32> = (0..6).collect();
        rng.shuffle(&mut wide);
        let mut neg = PyRandom::new(-((1i128 << 40) + 5));
        let mut again: Vec<u32> = (0..6).collect();
        neg.shuffle(&mut again);
        assert_eq!(wide, vec![1, 0, 3, 2, 5, 4]);
        assert_eq!(wide, again);
        // python3 -c 'import random;random.seed(0);x=list(range(6));random.shuffle(x);print(x)'
        let mut zero: Vec<u32> = (0..6).collect();
        PyRandom::new(0).shuffle(&mut zero);
        assert_eq!(zero, vec![4, 2, 1, 0, 5, 3]);
    }
}
