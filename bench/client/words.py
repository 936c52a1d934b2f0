"""A fixed English word list: the vocabulary of the 'words' token source and the seed text from
which a tokenizer's pool of ordinary tokens is drawn. Fixed here (not read from the system) so the
same seed builds the same prompts on every machine."""

from __future__ import annotations

WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is that for it as was with be by on not he this are or his from at which but
    have an they you were her she there one all we their been has when who will more no if out so
    said what up its about into than them can only other new some could time these two may then do
    first any my now such like our over man me even most made after also did many before must
    through back years where much your way well down should because each just those people how too
    little state good very make world still own see men work long get here between both life being
    under never day same another know while last might us great old year off come since against go
    came right used take three himself few house use during without again place around however home
    small found thought went say part once general high upon school every does got united left number
    course war until always away something fact though water less public put think almost hand enough
    far took head yet government system better set told nothing night end why called didn find going
    look asked later knew point next city business give group toward young days let room president
    side social given present several order national possible rather second face per among form
    important often things looked early white case john become large big need four within felt along
    children saw best church ever least power development light thing seemed family interest want
    members mind country area others done turned although open problem real free
    """.split()
)
