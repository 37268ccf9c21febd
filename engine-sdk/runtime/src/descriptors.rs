//! The file descriptor limit. Each connection, store file and channel
//! holds a descriptor; a soft limit of 1,024 (a common default) is
//! exhausted by as many idle connections, and then the store, PostgreSQL
//! and engine channels fail with them. A server raises its soft limit to
//! the hard one at start and sizes its connection caps within it.

use std::io;

/// Raises this process's soft limit on open files as far as its hard
/// limit allows; the limit now.
pub fn raise() -> io::Result<u64> {
    rlimit::increase_nofile_limit(u64::MAX)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let raised = super::raise().unwrap();
        let (soft, hard) = rlimit::Resource::NOFILE.get().unwrap();
        assert_eq!(raised, soft);
        // Some systems cap the soft limit below an unlimited hard one (macOS: OPEN_MAX).
        assert!(soft == hard || hard == rlimit::INFINITY, "soft {soft}, hard {hard}");
    }
}
