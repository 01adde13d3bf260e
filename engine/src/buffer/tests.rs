//! The buffers' unit tests.

use super::*;

#[test]
fn host_buffer_is_page_aligned_and_bounds_checked() {
    let b = Buffer::host(3 * 4096).unwrap();
    assert_eq!(b.addr().unwrap() % 4096, 0);
    b.write_at(4096, b"kv").unwrap();
    let mut out = [0u8; 2];
    b.read_at(4096, &mut out).unwrap();
    assert_eq!(&out, b"kv");
    let err = b.write_at(3 * 4096 - 1, b"kv").unwrap_err();
    assert!(err.to_string().contains("outside the 12288-byte buffer"), "{err}");
    assert!(matches!(Buffer::host(0), Err(BufferError::ZeroLength)));
}

#[test]
fn memfd_buffer_is_shared_through_its_fd() {
    let a = Buffer::memfd("pdstor-test", 8192).unwrap();
    a.write_at(100, b"prefill").unwrap();
    let dup = a.memfd_fd().unwrap().try_clone_to_owned().unwrap();
    let b = Buffer::from_memfd(dup, 8192).unwrap();
    let mut out = [0u8; 7];
    b.read_at(100, &mut out).unwrap();
    assert_eq!(&out, b"prefill");
    b.write_at(0, b"decode").unwrap();
    let mut back = [0u8; 6];
    a.read_at(0, &mut back).unwrap();
    assert_eq!(&back, b"decode", "writes through one mapping are seen through the other");
}

#[test]
fn in_place_checksums_match_the_crc32c_crate_everywhere() {
    let len = 3 * (64 << 10) + 8192;
    let b = Buffer::memfd("crc", len).unwrap();
    let bytes: Vec<u8> = (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2]).collect();
    b.write_at(0, &bytes).unwrap();
    for (off, n) in [(0, 0), (0, 1), (7, 65_535), (0, 65_536), (1, 65_537), (4096, 2 * 65_536 + 3), (0, len)] {
        // Two independent implementations (crc-fast, the crc32c crate) agree.
        assert_eq!(b.crc32c(off as u64, n).unwrap(), crc32c::crc32c(&bytes[off..off + n]), "{off}+{n}");
    }
    assert!(matches!(b.crc32c(len as u64 - 1, 2), Err(BufferError::OutOfBounds { .. })));
}

#[test]
fn received_memfd_smaller_than_claimed_is_refused() {
    let a = Buffer::memfd("small", 4096).unwrap();
    let dup = a.memfd_fd().unwrap().try_clone_to_owned().unwrap();
    assert!(matches!(Buffer::from_memfd(dup, 8192), Err(BufferError::OutOfBounds { .. })));
}

/// An unsealed memfd: what a /dev/shm object is to the kernel (both are
/// tmpfs files), made here without needing /dev/shm mounted.
fn unsealed_shm(len: usize) -> OwnedFd {
    let fd = nix::sys::memfd::memfd_create("shm-test", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
    File::from(fd.try_clone().unwrap()).set_len(len as u64).unwrap();
    fd
}

#[test]
fn a_received_shm_file_is_reached_through_its_file_and_survives_a_truncation() {
    let len = 3 * (256 << 10) + 4096;
    let fd = unsealed_shm(len);
    let owner = Buffer::from_shm_file(fd.try_clone().unwrap(), len, true).unwrap();
    let received = Buffer::from_shm_file(fd.try_clone().unwrap(), len, false).unwrap();
    assert_eq!(received.kind(), BufferKind::ShmFile);
    assert_eq!(received.addr().unwrap() % 4096, 0, "mapped for the kernel's I/O");
    let mut bytes: Vec<u8> = (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1]).collect();
    owner.write_at(0, &bytes).unwrap();
    for (off, n) in [(0, 1), (5, 256 << 10), (4096, len - 4096), (0, len)] {
        assert_eq!(received.crc32c(off as u64, n).unwrap(), crc32c::crc32c(&bytes[off..off + n]), "{off}+{n}");
    }
    received.write_at(8, b"decode").unwrap();
    let mut out = [0u8; 6];
    owner.read_at(8, &mut out).unwrap();
    assert_eq!(&out, b"decode");
    bytes[8..14].copy_from_slice(b"decode");
    assert!(matches!(received.slice(0, 1), Err(BufferError::FileAccessOnly)));
    assert!(matches!(received.as_mut_ptr(), Err(BufferError::FileAccessOnly)));

    // The owner shrinks the file: every access of the received buffer
    // past the new end fails with an error, none faults.
    assert!(!received.found_shrunk(), "checked in place, whole");
    File::from(fd).set_len(4096).unwrap();
    let err = received.crc32c(0, len).unwrap_err();
    assert!(err.to_string().contains("did its owner shrink"), "{err}");
    assert!(received.found_shrunk(), "the in-place check's SIGBUS was caught, not fatal");
    assert!(matches!(received.addr(), Err(BufferError::Shrunk)), "no transfer uses its zero pages");
    assert!(received.read_at(8192, &mut out).is_err());
    assert_eq!(received.crc32c(0, 4096).unwrap(), crc32c::crc32c(&bytes[..4096]), "what is left still reads");
}

/// A SIGBUS outside a guarded check is not swallowed: the process still
/// dies of it (the test runs itself as a child that faults).
#[test]
fn a_fault_outside_a_guarded_check_still_kills_the_process() {
    const CHILD: &str = "PDSTOR_TEST_SIGBUS_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let fd = unsealed_shm(8192);
        let received = Buffer::from_shm_file(fd.try_clone().unwrap(), 8192, false).unwrap();
        received.crc32c(0, 8192).unwrap(); // the handler is installed
        let owner = Buffer::from_shm_file(fd.try_clone().unwrap(), 8192, true).unwrap();
        File::from(fd).set_len(0).unwrap();
        let mut out = [0u8; 1];
        owner.slice(4096, 1).unwrap().copy_to(&mut out[..]); // SIGBUS, unguarded
        std::process::exit(0);
    }
    let me = std::env::current_exe().unwrap();
    let name = "buffer::tests::a_fault_outside_a_guarded_check_still_kills_the_process";
    let status = std::process::Command::new(me)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGBUS), "{status:?}");
}

#[test]
fn only_tmpfs_files_of_the_size_asked_are_shm_files() {
    let small = unsealed_shm(4096);
    let err = Buffer::from_shm_file(small, 8192, false).unwrap_err();
    assert!(err.to_string().contains("4096 bytes long"), "{err}");
    let dir = std::env::current_dir().unwrap();
    let on_disk = tempfile_in(&dir);
    let err = Buffer::from_shm_file(on_disk, 4096, false).unwrap_err();
    assert!(matches!(err, BufferError::NotShmFile(_)) || dir.starts_with("/dev/shm"), "{err}");
}

/// An unlinked 4096-byte file in `dir`.
fn tempfile_in(dir: &std::path::Path) -> OwnedFd {
    let path = dir.join(format!(".shm-test-{}", std::process::id()));
    let f = File::options().create(true).truncate(true).read(true).write(true).open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    f.set_len(4096).unwrap();
    f.into()
}
