/* What a container sees of a device node: for each path, its mode, owner and numbers, whether a
 * read-write open succeeds (or its errno's name), and KVM_GET_API_VERSION on it. Built static
 * (gcc -static) as the only file of the runtime tests' image (tests/runtime/oci_runtime.py). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#define KVM_GET_API_VERSION 0xAE00

static const char *errno_name(int e) {
    switch (e) {
    case EACCES: return "EACCES";
    case EPERM: return "EPERM";
    case ENOENT: return "ENOENT";
    case ENXIO: return "ENXIO";
    case ENODEV: return "ENODEV";
    case EROFS: return "EROFS";
    default: return "EOTHER";
    }
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) == 0)
            printf("stat %s mode=%o uid=%u gid=%u rdev=%u:%u\n", argv[i], st.st_mode & 07777, st.st_uid, st.st_gid,
                   major(st.st_rdev), minor(st.st_rdev));
        int fd = open(argv[i], O_RDWR | O_CLOEXEC);
        if (fd < 0) {
            printf("open %s errno=%s\n", argv[i], errno_name(errno));
            continue;
        }
        printf("open %s ok ioctl=%d\n", argv[i], ioctl(fd, KVM_GET_API_VERSION, 0));
        close(fd);
    }
    printf("uid=%u gid=%u\n", getuid(), getgid());
    return 0;
}
