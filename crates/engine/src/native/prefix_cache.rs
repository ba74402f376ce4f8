//! Prefix reuse: full KV blocks are remembered by the tokens they hold and every token
//! before them (a chain of block hashes, i.e. a radix tree with one block per edge), so an
//! episode's next turn and the shared system prompt of a group are computed once.
//! Unreferenced leaves are evicted least recently used first.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::ops::Bound;

use super::block_pool::BlockPool;

#[derive(Debug)]
struct Node {
    block: u32,
    tokens: Vec<u32>,
    parent: Option<u64>,
    children: u32,
    last_used: u64,
}

/// The cache holds one reference on each block it remembers.
#[derive(Debug, Default)]
pub struct PrefixCache {
    block_size: usize,
    nodes: HashMap<u64, Node>,
    /// The nodes without children, by (last use, key): the only ones eviction may take.
    /// Only leaves, because a lookup or insert touches a chain from its root down, so a
    /// node is never used more recently than its children: scanning every node in LRU
    /// order instead met a whole batch's interior blocks before each victim (quadratic:
    /// evicting a 256 × 512-token batch took ~0.5 s of the engine thread).
    leaves: BTreeSet<(u64, u64)>,
    clock: u64,
}

fn chain_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl PrefixCache {
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            ..Self::default()
        }
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    fn touch(&mut self, key: u64) {
        self.clock += 1;
        if let Some(node) = self.nodes.get_mut(&key) {
            if node.children == 0 {
                self.leaves.remove(&(node.last_used, key));
                self.leaves.insert((self.clock, key));
            }
            node.last_used = self.clock;
        }
    }

    /// The cached blocks holding the longest prefix of `tokens` made of whole blocks and
    /// at most `max_tokens` long, and the key of the last one; each returned block gets a
    /// reference for the caller.
    pub fn lookup(
        &mut self,
        tokens: &[u32],
        max_tokens: usize,
        pool: &mut BlockPool,
    ) -> (Vec<u32>, Option<u64>) {
        let mut blocks = Vec::new();
        let mut parent = None;
        for chunk in tokens[..max_tokens.min(tokens.len())].chunks_exact(self.block_size) {
            let key = chain_hash(parent, chunk);
            match self.nodes.get(&key) {
                Some(node) if node.tokens == chunk && node.parent == parent => {
                    pool.incref(node.block);
                    blocks.push(node.block);
                }
                _ => break,
            }
            self.touch(key);
            parent = Some(key);
        }
        (blocks, parent)
    }

    /// Remembers `blocks[i]` as holding `tokens[i*bs..(i+1)*bs]`, following the block
    /// whose key is `parent` (`None`: the start of a sequence). Blocks already known
    /// (another sequence computed the same prefix) are left to their owner. Returns the
    /// key of the last block, or `Err(())` on a hash collision (stop caching that chain).
    pub fn insert(
        &mut self,
        mut parent: Option<u64>,
        tokens: &[u32],
        blocks: &[u32],
        pool: &mut BlockPool,
    ) -> Result<Option<u64>, ()> {
        for (chunk, &block) in tokens.chunks_exact(self.block_size).zip(blocks) {
            let key = chain_hash(parent, chunk);
            match self.nodes.get(&key) {
                Some(node) if node.tokens == chunk && node.parent == parent => {}
                Some(_) => return Err(()),
                None => {
                    pool.incref(block);
                    if let Some((pk, p)) =
                        parent.and_then(|pk| Some((pk, self.nodes.get_mut(&pk)?)))
                    {
                        if p.children == 0 {
                            self.leaves.remove(&(p.last_used, pk));
                        }
                        p.children += 1;
                    }
                    self.nodes.insert(
                        key,
                        Node {
                            block,
                            tokens: chunk.to_vec(),
                            parent,
                            children: 0,
                            last_used: 0,
                        },
                    );
                    self.leaves.insert((0, key));
                }
            }
            self.touch(key);
            parent = Some(key);
        }
        Ok(parent)
    }

    /// Frees up to `want` blocks that only the cache holds, least recently used leaves
    /// first; a victim's parent, once childless, was used no later than the victim, so it
    /// goes next if nothing else holds it. Returns how many went back to the pool.
    pub fn evict(&mut self, want: usize, pool: &mut BlockPool) -> usize {
        let mut freed = 0;
        // Leaves up to here are held by running sequences: this call frees none of those.
        let mut held: Option<(u64, u64)> = None;
        while freed < want {
            let next = match held {
                None => self.leaves.iter().next(),
                Some(h) => self
                    .leaves
                    .range((Bound::Excluded(h), Bound::Unbounded))
                    .next(),
            };
            let Some(&(stamp, key)) = next else { break };
            if pool.refcount(self.nodes[&key].block) != 1 {
                held = Some((stamp, key));
                continue;
            }
            self.leaves.remove(&(stamp, key));
            // The leaf, then each ancestor it leaves childless and only the cache holds.
            let mut victim = Some(key);
            while let Some(key) = victim.take() {
                let node = self.nodes.remove(&key).expect("leaves are nodes");
                if pool.decref(node.block) {
                    freed += 1;
                }
                let Some(pk) = node.parent else { break };
                let Some(p) = self.nodes.get_mut(&pk) else {
                    break;
                };
                p.children -= 1;
                if p.children > 0 {
                    break;
                }
                if freed < want && pool.refcount(p.block) == 1 {
                    victim = Some(pk);
                } else {
                    self.leaves.insert((p.last_used, pk));
                }
            }
        }
        freed
    }

    /// Forgets every prefix (after a weight update the cached keys and values are stale).
    pub fn clear(&mut self, pool: &mut BlockPool) {
        for (_, node) in self.nodes.drain() {
            pool.decref(node.block);
        }
        self.leaves.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_is_found_block_by_block_and_evicted_when_unused() {
        let mut pool = BlockPool::new(8);
        let mut cache = PrefixCache::new(2);
        let tokens = [1, 2, 3, 4, 5];
        let blocks: Vec<u32> = (0..2).map(|_| pool.alloc().unwrap()).collect();
        cache
            .insert(None, &tokens[..4], &blocks, &mut pool)
            .unwrap();
        for &b in &blocks {
            assert!(!pool.decref(b), "the cache keeps its own reference");
        }
        assert_eq!(cache.lookup(&[1, 2, 3, 9], 4, &mut pool).0, vec![blocks[0]]);
        assert_eq!(cache.lookup(&tokens, 4, &mut pool).0, blocks);
        // A different first block never matches a later one.
        assert!(cache.lookup(&[7, 7, 3, 4], 4, &mut pool).0.is_empty());
        // Still referenced by the lookups above: nothing to evict.
        assert_eq!(cache.evict(2, &mut pool), 0);
        pool.decref(blocks[0]);
        for &b in &blocks {
            pool.decref(b);
        }
        assert_eq!(cache.evict(8, &mut pool), 2);
        assert!(cache.is_empty());
        assert_eq!(pool.num_free(), 8);
    }

    /// Chains of three one-token blocks: A (oldest), B (a running sequence still holds
    /// its blocks), C (newest); D shares C's first block.
    #[test]
    fn eviction_takes_old_chains_leaf_first_and_skips_what_sequences_hold() {
        let mut pool = BlockPool::new(16);
        let mut cache = PrefixCache::new(1);
        let mut chain = |tokens: &[u32], cache: &mut PrefixCache| -> Vec<u32> {
            let blocks: Vec<u32> = tokens.iter().map(|_| pool.alloc().unwrap()).collect();
            cache.insert(None, tokens, &blocks, &mut pool).unwrap();
            blocks
        };
        let a = chain(&[1, 2, 3], &mut cache);
        let b = chain(&[4, 5, 6], &mut cache);
        let c = chain(&[7, 8, 9], &mut cache);
        // D's first block is C's, left to C's owner.
        let d = chain(&[7, 10], &mut cache);
        // The sequences of A, C and D finished; B's runs on.
        for &x in a.iter().chain(&c).chain(&d) {
            pool.decref(x);
        }
        let free = pool.num_free();
        // Four blocks: all of A (its leaf, then the ancestors it leaves childless), then
        // the oldest remaining leaf that nothing holds: C's last block.
        assert_eq!(cache.evict(4, &mut pool), 4);
        assert_eq!(pool.num_free(), free + 4);
        let (found, _) = cache.lookup(&[1, 2, 3], 3, &mut pool);
        assert!(found.is_empty(), "A is gone");
        let (found, _) = cache.lookup(&[7, 8, 9], 3, &mut pool);
        assert_eq!(found, c[..2], "C lost its leaf only");
        for &x in &found {
            pool.decref(x);
        }
        // Everything else that only the cache holds: D's leaf, then C's 8 and, childless
        // now, the first block C and D shared; B's blocks stay, its sequence holds them.
        assert_eq!(cache.evict(100, &mut pool), 3);
        let (found, _) = cache.lookup(&[4, 5, 6], 3, &mut pool);
        assert_eq!(found, b, "B is kept while held");
        for &x in found.iter().chain(&b) {
            pool.decref(x);
        }
        assert_eq!(cache.evict(100, &mut pool), 3);
        assert!(cache.is_empty());
        assert_eq!(pool.num_free(), 16);
    }
}
