//! Turning a hung ring into a failed one (rank 0 of a served group, when a
//! worker goes silent mid-step).
//!
//! MLX's ring backend has no timeouts: a collective waits forever for a peer
//! that is alive but silent, and `accept` during init waits forever for a
//! peer that never comes. It does notice a socket that reads 0 bytes or
//! fails to send: after a few such errors it fails the collective with
//! "[ring] connection to a peer was lost", which `eval` returns as an error.
//! `shutdown(2)` on our own end of each ring socket produces exactly that
//! (and wakes a blocked `accept` on Linux with EINVAL), so a deadline we
//! enforce outside MLX becomes an ordinary error inside it.
//!
//! The ring's sockets are private to MLX, so we find them among the
//! process's descriptors by address: listening and accepted sockets have
//! this rank's ring address as their local address; connected ones have the
//! right neighbour's as their peer. Those ports serve nothing else (the
//! control channel and HTTP listen elsewhere), so nothing else is cut.
//!
//! Linux only (`/proc/self/fd`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Shuts down (both directions) every TCP socket of this process whose local
/// address is in `local` or whose peer address is in `peers` (a ring's
/// addresses serve nothing else). Returns how
/// many were cut. Safe to call repeatedly and concurrently with MLX using
/// the sockets (that is the point); it never closes a descriptor.
pub fn sever(local: &[SocketAddr], peers: &[SocketAddr]) -> usize {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return 0;
    };
    let mut cut = 0;
    for entry in entries.flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<libc::c_int>().ok())
        else {
            continue;
        };
        // Only sockets: the link reads "socket:[inode]".
        let is_socket = std::fs::read_link(entry.path())
            .map(|target| target.to_string_lossy().starts_with("socket:"))
            .unwrap_or(false);
        if !is_socket {
            continue;
        }
        let matches = sock_name(fd, false).is_some_and(|a| local.contains(&a))
            || sock_name(fd, true).is_some_and(|a| peers.contains(&a));
        // SAFETY: shutdown on a descriptor number; at worst (reused since the
        // scan) it hits another socket with the same address, which by the
        // check above is again a ring socket of ours.
        if matches && unsafe { libc::shutdown(fd, libc::SHUT_RDWR) } == 0 {
            cut += 1;
        }
    }
    cut
}

/// The local (`peer = false`) or remote address of socket `fd`, for IPv4/6.
fn sock_name(fd: libc::c_int, peer: bool) -> Option<SocketAddr> {
    // SAFETY: `storage` is large enough for any address; `len` says how
    // much the kernel filled; we read only the family it reports.
    unsafe {
        let mut storage: libc::sockaddr_storage = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        let ptr = &mut storage as *mut libc::sockaddr_storage as *mut libc::sockaddr;
        let status = if peer {
            libc::getpeername(fd, ptr, &mut len)
        } else {
            libc::getsockname(fd, ptr, &mut len)
        };
        if status != 0 {
            return None;
        }
        match storage.ss_family as libc::c_int {
            libc::AF_INET => {
                let a = &*(ptr as *const libc::sockaddr_in);
                let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(a.sin_port)))
            }
            libc::AF_INET6 => {
                let a = &*(ptr as *const libc::sockaddr_in6);
                let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
                Some(SocketAddr::new(IpAddr::V6(ip), u16::from_be(a.sin6_port)))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn a_blocked_read_on_a_severed_socket_returns_eof() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = TcpStream::connect(addr).unwrap();
        let (_server, _) = listener.accept().unwrap();
        let reader = std::thread::spawn(move || {
            let mut client = client;
            let mut byte = [0u8; 1];
            client.read(&mut byte).unwrap()
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        // The listener and the accepted socket have `addr` as local address;
        // the client has it as peer: all three are cut.
        assert_eq!(sever(&[addr], &[addr]), 3);
        assert_eq!(reader.join().unwrap(), 0);
    }
}
