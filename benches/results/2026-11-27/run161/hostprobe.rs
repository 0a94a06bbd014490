// Is the GPU host's bimodality the host's? Three CPU-only loops timed in blocks, no CUDA:
// alu (a splitmix64 chain: latency-bound arithmetic), chase (a random pointer chase over
// 64 MiB: memory latency), btree (BTreeMap insert/remove of random keys, a few thousand live:
// branchy, cache-resident, like an allocator's index). One line per round.
use std::collections::BTreeMap;
use std::time::Instant;
fn sm(s: &mut u64) -> u64 { *s = s.wrapping_add(0x9E3779B97F4A7C15); let mut z = *s;
  z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9); z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB); z ^ (z >> 31) }
fn main() {
  let rounds: usize = std::env::args().nth(1).map(|a| a.parse().unwrap()).unwrap_or(30);
  let n = 8 << 20; let mut perm: Vec<u32> = (0..n as u32).collect(); let mut s = 7u64;
  for i in (1..n).rev() { let j = (sm(&mut s) % (i as u64 + 1)) as usize; perm.swap(i, j); }
  let mut next = vec![0u32; n]; for i in 0..n { next[perm[i] as usize] = perm[(i + 1) % n]; }
  let mut map = BTreeMap::new(); let mut keys: Vec<u64> = Vec::new();
  for r in 0..rounds {
    let t = Instant::now(); let mut x = r as u64; for _ in 0..20_000_000 { let mut t = x; x = sm(&mut t); } let alu = t.elapsed().as_nanos() as f64 / 2e7;
    std::hint::black_box(x);
    let t = Instant::now(); let mut p = 0u32; for _ in 0..2_000_000 { p = next[p as usize]; } let chase = t.elapsed().as_nanos() as f64 / 2e6;
    std::hint::black_box(p);
    let t = Instant::now();
    for _ in 0..1_000_000 { let a = sm(&mut s); if keys.len() < 2000 || (a & 1 == 0 && keys.len() < 4000) { map.insert(a, r); keys.push(a); }
      else { let i = (a >> 1) as usize % keys.len(); let k = keys.swap_remove(i); map.remove(&k); } }
    let bt = t.elapsed().as_nanos() as f64 / 1e6;
    println!("round {r:2} alu {alu:6.3} chase {chase:6.1} btree {bt:6.1}");
  }
}
