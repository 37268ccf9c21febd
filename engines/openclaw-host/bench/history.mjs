// The benchmark's sessions: `n` alternating user and assistant messages of
// ~40 tokens each, and the user message of the turn being assembled.
const words = "the build failed on the integration step and we traced it to a stale cache entry in the runner".split(" ");

export function history(n) {
  const t0 = Date.now() - n * 1000;
  return Array.from({ length: n }, (_, i) => ({
    id: `m${i}`,
    role: i % 2 === 0 ? "ROLE_USER" : "ROLE_ASSISTANT",
    createdAtUnixMs: t0 + i * 1000,
    content: [{ text: `#${i}: ${Array.from({ length: 28 }, (_, k) => words[(i * 7 + k) % words.length]).join(" ")}` }],
  }));
}

export function nextTurn(n) {
  return { id: `q${n}`, role: "ROLE_USER", createdAtUnixMs: Date.now(), content: [{ text: "what did we find about the cache?" }] };
}

export function percentile(sorted, p) {
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

/** Calls `fn` 5 times to warm up, then `rounds` times timed: p50, p99 (ms) and the last result. */
export async function timed(rounds, fn) {
  let out;
  for (let i = 0; i < 5; i++) out = await fn();
  const took = [];
  for (let i = 0; i < rounds; i++) {
    const t = process.hrtime.bigint();
    out = await fn();
    took.push(Number(process.hrtime.bigint() - t) / 1e6);
  }
  took.sort((a, b) => a - b);
  return { rounds, p50: percentile(took, 50), p99: percentile(took, 99), out };
}
