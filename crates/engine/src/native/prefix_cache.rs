//! Prefix reuse: full KV blocks are remembered by the tokens they hold and every token
//! before them (a chain of block hashes, i.e. a radix tree with one block per edge), so an
//! episode's next turn and the shared system prompt of a group are computed once.
//! Unreferenced leaves are evicted least recently used first.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};

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
    lru: BTreeSet<(u64, u64)>,
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
            self.lru.remove(&(node.last_used, key));
            node.last_used = self.clock;
            self.lru.insert((self.clock, key));
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
                    if let Some(p) = parent.and_then(|p| self.nodes.get_mut(&p)) {
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
                    self.lru.insert((0, key));
                }
            }
            self.touch(key);
            parent = Some(key);
        }
        Ok(parent)
    }

    /// Frees up to `want` blocks that only the cache holds, oldest leaves first.
    /// Returns how many went back to the pool.
    pub fn evict(&mut self, want: usize, pool: &mut BlockPool) -> usize {
        let mut freed = 0;
        while freed < want {
            let victim = self.lru.iter().copied().find(|(_, key)| {
                let node = &self.nodes[key];
                node.children == 0 && pool.refcount(node.block) == 1
            });
            let Some((stamp, key)) = victim else { break };
            self.lru.remove(&(stamp, key));
            let node = self.nodes.remove(&key).expect("lru entries have nodes");
            if let Some(p) = node.parent.and_then(|p| self.nodes.get_mut(&p)) {
                p.children -= 1;
            }
            if pool.decref(node.block) {
                freed += 1;
            }
        }
        freed
    }

    /// Forgets every prefix (after a weight update the cached keys and values are stale).
    pub fn clear(&mut self, pool: &mut BlockPool) {
        for (_, node) in self.nodes.drain() {
            pool.decref(node.block);
        }
        self.lru.clear();
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
}
