//! A process's CPU time from `/proc/<pid>/stat`, for benchmarks that
//! charge a piece of work to the process that did it.

use std::time::Duration;

/// The fields of `/proc/<pid>/stat` after the command name (which may hold
/// spaces), from its third on.
pub struct ProcStat(Vec<u64>);

/// `pid`'s stat, or `None` once it has exited.
pub fn proc_stat(pid: u32) -> Option<ProcStat> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    // The state is a letter: read as 0, it is never used.
    Some(ProcStat(rest.split_whitespace().map(|f| f.parse().unwrap_or(0)).collect()))
}

impl ProcStat {
    pub fn ppid(&self) -> Option<u32> {
        self.0.get(1).map(|&p| p as u32)
    }

    /// User + system time the process has used.
    pub fn cpu(&self) -> Duration {
        ticks(&self.0, &[11, 12])
    }

    /// User + system time of its exited children it has reaped.
    pub fn reaped(&self) -> Duration {
        ticks(&self.0, &[13, 14])
    }
}

fn ticks(fields: &[u64], at: &[usize]) -> Duration {
    // USER_HZ is 100 on Linux.
    Duration::from_millis(at.iter().filter_map(|&i| fields.get(i)).sum::<u64>() * 10)
}
